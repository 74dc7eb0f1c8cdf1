"""The engine link fails closed: hostile fake engines, accept timeout, supervision and restart."""
from __future__ import annotations

import concurrent.futures as cf
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import LiveServer

FAKE = Path(__file__).parent / "fakes" / "fake_engine.py"
hostile_log: list[Path] = []


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile") / "frames.log"
    log.write_text("")
    hostile_log.append(log)
    s = LiveServer(["--engine-command", f"{sys.executable} {FAKE} hostile {log}", "--max-restarts", "100"],
                   env={"PROBITY_ACCEPT_TIMEOUT": "1.5", "PROBITY_FRAME_TIMEOUT": "1"}, startup=30)
    yield s
    s.stop()


def send(server, scenario: str, stream: bool = False, timeout: float = 20) -> httpx.Response:
    body = {"model": "fake", "prompt": scenario, "max_tokens": 2, "stream": stream}
    if "echo" in scenario:
        body["echo"] = True
    return server.post("/v1/completions", json=body, timeout=timeout)


def wait_healthy(server, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server.get("/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not back within {within}s: {server.get('/health').text}")


def assert_recovers(server) -> None:
    wait_healthy(server)
    r = send(server, "ok")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AA", r.text
    assert server.get("/health").json()["engine"]["in_flight"] == 0


VIOLATIONS = ["bad_header", "oversize_length", "short_payload_then_exit", "short_payload_then_stall",
              "missing_terminator", "bad_json", "unknown_kind", "foreign_id", "second_accept",
              "token_before_accept", "member_out_of_range", "echo_out_of_order", "die_before_accept",
              "die_after_accept", "die_mid_echo", "die_mid_stream", "error_zero"]


@pytest.mark.parametrize("scenario", VIOLATIONS)
def test_hostile_engine_fails_the_request_with_a_named_500_and_restarts(hostile, scenario):
    restarts = hostile.get("/health").json()["engine"]["restarts"]
    t0 = time.monotonic()
    r = send(hostile, scenario)
    assert time.monotonic() - t0 < 5
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    assert_recovers(hostile)
    assert hostile.get("/health").json()["engine"]["restarts"] > restarts


@pytest.mark.parametrize("scenario", ["die_mid_stream", "bad_json", "short_payload_then_stall"])
def test_failure_after_commit_ends_the_stream_without_done(hostile, scenario):
    r = send(hostile, scenario, stream=True)
    assert r.status_code == 200  # committed on ACCEPT
    assert "[DONE]" not in r.text and "error" not in r.text and r.text.count("HTTP/") == 0
    assert_recovers(hostile)


def test_frame_after_done_is_a_violation(hostile):
    r = send(hostile, "frame_after_done")
    # the request itself finished before the stray frame; the violation restarts the engine
    assert r.status_code in (200, 500)
    assert_recovers(hostile)


def test_silent_engine_gets_a_named_503_within_the_accept_timeout(hostile):
    t0 = time.monotonic()
    r = send(hostile, "silence")
    assert 1.0 <= time.monotonic() - t0 < 5
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_timeout"
    assert_recovers(hostile)


def test_reserved_group_frames_are_drained_without_effect(hostile):
    restarts = hostile.get("/health").json()["engine"]["restarts"]
    r = send(hostile, "grp_between_tokens")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AA"
    assert hostile.get("/health").json()["engine"]["restarts"] == restarts


def test_failed_write_to_the_engine_is_a_named_500_not_a_hang(hostile):
    wait_healthy(hostile)
    restarts = hostile.get("/health").json()["engine"]["restarts"]
    with cf.ThreadPoolExecutor(2) as pool:
        first = pool.submit(send, hostile, "close_stdin")
        time.sleep(0.5)
        second = send(hostile, "ok")
        assert second.status_code == 500 and second.json()["error"]["code"] == "engine_error"
        r = first.result()
        assert r.status_code in (500, 503) and r.json()["error"]["code"] in ("engine_error", "engine_timeout")
    assert_recovers(hostile)
    # the failed write and the EOF after it are one failure: one restart, and the new
    # engine is left alone (it is not killed by a second, late restart)
    pid = hostile.engine_pid()
    time.sleep(2.0)
    h = hostile.get("/health").json()
    assert h["status"] == "ok" and h["engine"]["pid"] == pid and h["engine"]["restarts"] == restarts + 1


def test_requests_while_the_engine_is_down_get_a_named_503(tmp_path):
    log = tmp_path / "frames.log"
    s = LiveServer(["--engine-command", f"{sys.executable} {FAKE} crash_after_first_start {log}",
                    "--max-restarts", "2"], expect_ready=False)
    try:
        def status():
            try:
                return s.get("/health").json()["status"]
            except httpx.HTTPError:
                return None
        deadline = time.monotonic() + 20
        while status() in (None, "ok") and time.monotonic() < deadline:
            time.sleep(0.05)
        while time.monotonic() < deadline and status() != "failed":
            r = send(s, "ok")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            assert "retry-after" in r.headers
            time.sleep(0.2)
        h = s.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert "exited" in h.json()["engine"]["last_error"]
        r = send(s, "ok")
        assert r.status_code == 503 and "not being restarted" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_accept_timeout_env_var_is_read_by_its_real_name(tmp_path):
    log = tmp_path / "frames.log"
    s = LiveServer(["--engine-command", f"{sys.executable} {FAKE} hostile {log}"],
                   env={"PROBITY_ACCEPT_TIMEOUT": "0.7"}, startup=30)
    try:
        t0 = time.monotonic()
        r = send(s, "silence")
        assert r.status_code == 503 and 0.6 <= time.monotonic() - t0 < 3
    finally:
        s.stop()


def test_seed_reaches_the_engine_in_the_submit(hostile):
    wait_healthy(hostile)
    r = hostile.post("/v1/completions", json={"model": "fake", "prompt": "ok", "max_tokens": 2, "seed": -7})
    assert r.status_code == 200
    last = [l for l in hostile_log[0].read_text().splitlines() if l.startswith("SUBMIT")][-1]
    assert '"seed": -7' in last


def test_failure_after_commit_is_logged_with_the_request_id(hostile):
    wait_healthy(hostile)
    r = hostile.post("/v1/completions", json={"model": "fake", "prompt": "die_mid_stream", "max_tokens": 2,
                                              "stream": True}, headers={"x-request-id": "req-trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-trace-42"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "request_id=req-trace-42 " not in hostile.log_path.read_text():
        time.sleep(0.1)
    log = hostile.log_path.read_text()
    assert "request_id=req-trace-42 response_id=cmpl-" in log and "stream ended after commit: code=engine_error" in log
    assert_recovers(hostile)
