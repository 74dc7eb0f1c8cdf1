"""Defaults that keep people out: auth, bind refusal, Host allowlist, CORS, deadlines, body caps."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ROOT, TINY_ID, LiveServer, tiny_args


@pytest.fixture
def keyed(servers, tiny_model_dir):
    return servers.get(tiny_args(tiny_model_dir, "--cors-origin", "https://app.example"),
                       env={"PROBITY_API_KEY": "s3cret"})


def test_api_key_from_env_guards_every_route_but_health(keyed):
    body = {"model": TINY_ID, "prompt": "Hi", "max_tokens": 1}
    r = keyed.post("/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert keyed.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert keyed.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert keyed.post("/v1/completions", json=body, headers={"x-api-key": "s3cret"}).status_code == 200
    r = keyed.post("/v1/messages", json={"model": TINY_ID, "max_tokens": 1, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert keyed.get("/metrics").status_code == 401
    assert keyed.get("/health").status_code == 200


def test_auth_refusals_are_logged(keyed):
    r = keyed.post("/v1/completions", json={}, headers={"x-request-id": "auth-refused-1"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    deadline = time.monotonic() + 10
    while "request_id=auth-refused-1 " not in keyed.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(l for l in keyed.log_path.read_text().splitlines() if "request_id=auth-refused-1 " in l)
    assert "method=POST path=/v1/completions status=401 code=invalid_api_key" in line


def test_cors_only_for_configured_origins(keyed):
    h = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
         "Access-Control-Request-Headers": "x-api-key,content-type"}
    pre = httpx.options(keyed.url + "/v1/completions", headers=h)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    bad = httpx.options(keyed.url + "/v1/completions", headers={**h, "Origin": "https://evil.example"})
    assert bad.headers.get("access-control-allow-origin") is None
    r = keyed.post("/v1/completions", json={}, headers={"Origin": "https://app.example", "x-api-key": "s3cret"})
    assert r.headers.get("access-control-allow-origin") == "https://app.example"
    r = keyed.post("/v1/completions", json={}, headers={"Origin": "https://evil.example", "x-api-key": "s3cret"})
    assert "access-control-allow-origin" not in r.headers


def test_options_needs_the_key_when_no_cors_origin_is_set(keyed_server):
    """Only a configured CORS layer answers preflights without a key; without one, OPTIONS is
    a request like any other and the key check holds."""
    for path in ("/v1/completions", "/metrics", "/v1/models"):
        r = httpx.options(keyed_server.url + path, headers={"Origin": "https://evil.example",
                                                             "Access-Control-Request-Method": "POST"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert "access-control-allow-origin" not in r.headers


def test_default_server_sends_no_cors_headers(tiny_server):
    r = tiny_server.post("/v1/completions", json={}, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_host_header_allowlist_blocks_dns_rebinding(tiny_server):
    r = tiny_server.get("/v1/models", headers={"Host": "attacker.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    assert tiny_server.get("/v1/models", headers={"Host": f"localhost:{tiny_server.port}"}).status_code == 200


def test_non_loopback_bind_without_key_is_refused_at_startup():
    p = subprocess.run([sys.executable, "-m", "probity", "serve", "--host", "0.0.0.0", "--port", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "without --api-key" in p.stderr


def test_missing_model_is_a_clear_startup_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "probity", "serve", "--model", str(tmp_path / "nope")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "not found" in p.stderr and f"no file or folder {tmp_path / 'nope'}" in p.stderr


def test_unreadable_model_is_a_clear_startup_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    p = subprocess.run([sys.executable, "-m", "probity", "serve", "--model", str(bad), "--port", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3
    assert "cannot load model" in p.stderr and "the engine did not start" in p.stderr
    assert "Traceback" not in p.stderr   # the engine's one line says why; the server adds one more


def test_trickled_request_head_is_cut_off(tiny_server, monkeypatch):
    from probity.server import http11

    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        data = s.recv(1024)  # the server closes the connection at its header deadline
        assert data == b"" and time.monotonic() - t0 <= http11.HEADER_TIMEOUT + 5


def test_trickled_body_gets_408(tiny_model_dir):
    s = LiveServer(["--model", str(tiny_model_dir), "--threads", "1", "--body-timeout", "1"])
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"mo")
            data = b""
            deadline = time.monotonic() + 10
            while b"request_timeout" not in data and time.monotonic() < deadline:
                chunk = c.recv(65536)
                if not chunk:
                    break
                data += chunk
            # the unread rest of the body cannot be taken for a next request: the server closes
            t_answer = time.monotonic()
            while chunk:
                chunk = c.recv(65536)
            assert time.monotonic() - t_answer < 2.5  # not at the keep-alive expiry, 5 s later
        assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data
    finally:
        s.stop()


def test_allowed_host_flag_replaces_the_default_list(tiny_model_dir):
    s = LiveServer(["--model", str(tiny_model_dir), "--threads", "1", "--allowed-host", "Models.Example",
                    "--allowed-host", "127.0.0.1"])
    try:
        assert s.get("/v1/models", headers={"Host": "models.example:8080"}).status_code == 200
        # `localhost` is in the default list, which the flag replaces
        r = s.get("/v1/models", headers={"Host": f"localhost:{s.port}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    finally:
        s.stop()


def test_allow_unauthenticated_remote_overrides_the_bind_refusal(tiny_model_dir):
    s = LiveServer(["--model", str(tiny_model_dir), "--threads", "1", "--host", "0.0.0.0",
                    "--allow-unauthenticated-remote"])
    try:
        # bound to every interface without a key: served, and any Host is accepted
        r = s.get("/v1/models", headers={"Host": "any.example"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == TINY_ID
    finally:
        s.stop()
