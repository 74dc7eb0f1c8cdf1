"""Hostile input is still just input: lone surrogates, deep nesting, odd bodies, headers and
paths get a named 4xx in the endpoint's envelope and leave nothing in flight."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from conftest import TINY_ID
from helpers import assert_named, nothing_in_flight, sse_events
from probity.server.errors import CODES

JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "Hi"}]


def raw_post(server, path: str, body: dict | str, headers: dict | None = None) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \udXXX (valid JSON); httpx's own encoder cannot
    data = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=data.encode(), headers={**JSON, **(headers or {})}, timeout=60)


S = "a\ud800b"  # a lone high surrogate; "\udc00" a lone low one
SURROGATE_CASES = [
    ("/v1/completions", {"model": TINY_ID, "prompt": S}, "prompt"),
    ("/v1/completions", {"model": TINY_ID, "prompt": ["ok", "x\udc00"]}, "prompt[1]"),
    ("/v1/completions", {"model": TINY_ID, "prompt": "ok", "stop": S}, "stop"),
    ("/v1/completions", {"model": TINY_ID, "prompt": "ok", "stop": ["a", S]}, "stop[1]"),
    ("/v1/completions", {"model": S, "prompt": "ok"}, "model"),
    ("/v1/completions", {"model": TINY_ID, "prompt": "ok", "user": S}, "user"),
    ("/v1/completions", {"model": TINY_ID, "prompt": "ok", "logit_bias": {S: 1}}, "logit_bias.a\\ud800b"),
    ("/v1/completions", {"model": TINY_ID, "pr\udc00ompt": "ok"}, "pr\\udc00ompt"),
    ("/v1/chat/completions", {"model": TINY_ID, "messages": [{"role": "user", "content": S}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": TINY_ID, "messages": [
        {"role": "user", "content": [{"type": "text", "text": S}]}]}, "messages[0].content[0].text"),
    ("/v1/chat/completions", {"model": TINY_ID, "messages": [{"role": S, "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": TINY_ID, "messages": USER, "stop": [S]}, "stop[0]"),
    ("/v1/messages", {"model": TINY_ID, "max_tokens": 2, "messages": [{"role": "user", "content": S}]},
     "messages[0].content"),
    ("/v1/messages", {"model": TINY_ID, "max_tokens": 2, "messages": USER, "system": S}, "system"),
    ("/v1/messages", {"model": TINY_ID, "max_tokens": 2, "messages": USER, "stop_sequences": [S]},
     "stop_sequences[0]"),
    ("/v1/messages", {"model": S, "max_tokens": 2, "messages": USER}, "model"),
    ("/v1/messages", {"model": TINY_ID, "max_tokens": 2, "messages": USER, "metadata": {"user_id": S}},
     "metadata.user_id"),
    ("/v1/messages/count_tokens", {"model": TINY_ID, "messages": [{"role": "user", "content": S}]},
     "messages[0].content"),
    ("/v1/messages/count_tokens", {"model": TINY_ID, "messages": USER, "sys\ud800": "x"}, "sys\\ud800"),
    ("/tokenize", {"model": TINY_ID, "prompt": S}, "prompt"),
    ("/tokenize", {"model": TINY_ID, "messages": [{"role": "user", "content": S}]}, "messages[0].content"),
    ("/detokenize", {"model": S, "tokens": [1]}, "model"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_CASES, ids=[f"{p}:{q}" for p, _, q in SURROGATE_CASES])
def test_lone_surrogates_are_a_named_400_and_leave_nothing_in_flight(tiny_server, path, body, param):
    r = raw_post(tiny_server, path, body)
    assert_named(r, path.startswith("/v1/messages"), 400, "invalid_value", param)
    nothing_in_flight(tiny_server)


def test_a_loop_of_surrogate_requests_exhausts_nothing(tiny_server):
    for _ in range(50):
        assert raw_post(tiny_server, "/v1/completions", {"model": TINY_ID, "prompt": S}).status_code == 400
    nothing_in_flight(tiny_server)
    assert raw_post(tiny_server, "/v1/completions", {"model": TINY_ID, "prompt": "ok", "max_tokens": 1}).status_code == 200


def test_paired_surrogate_escapes_are_text(tiny_server, tiny_hf):
    _, tok = tiny_hf
    r = raw_post(tiny_server, "/tokenize", {"model": TINY_ID, "prompt": "emoji \U0001F600"})  # \ud83d\ude00 on the wire
    assert r.status_code == 200 and r.json()["tokens"] == tok("emoji \U0001F600")["input_ids"]


@pytest.mark.parametrize("depth", [65, 200, 50_000])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_deep_nesting_is_a_named_400_not_a_recursion_error(tiny_server, path, depth):
    r = raw_post(tiny_server, path, '{"model": "%s", "prompt": %s%s}' % (TINY_ID, "[" * depth, "]" * depth))
    assert_named(r, path == "/v1/messages", 400, "invalid_body", None)
    nothing_in_flight(tiny_server)


def test_nesting_within_the_bound_is_validated_normally(tiny_server):
    r = raw_post(tiny_server, "/v1/completions", '{"model": "%s", "prompt": "x", "user": %s1%s}'
                 % (TINY_ID, "[" * 60, "]" * 60))
    assert_named(r, False, 400, "invalid_type", "user")


@pytest.mark.parametrize("data,code", [
    ('{"model": "m", "model": "m"}', "invalid_json"),                      # duplicate keys are ambiguous
    ('{"prompt": Infinity}', "invalid_json"), ('{"prompt": -Infinity}', "invalid_json"),
    ('{"prompt": NaN}', "invalid_json"),
    ("\ufeff{}", "invalid_json"),                                          # a BOM is not JSON text
])
def test_non_standard_json_is_named(tiny_server, data, code):
    r = raw_post(tiny_server, "/v1/completions", data)
    assert_named(r, False, 400, code, None)


def test_invalid_utf8_is_named_in_both_envelopes(tiny_server):
    for path in ("/v1/completions", "/v1/messages"):
        r = httpx.post(tiny_server.url + path, content=b'{"prompt": "\xed\xa0\x80"}', headers=JSON)
        assert_named(r, path == "/v1/messages", 400, "invalid_json", None)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_declared_non_json_body_is_415(tiny_server, ctype):
    body = json.dumps({"model": TINY_ID, "prompt": "Hi", "max_tokens": 1}).encode()
    r = httpx.post(tiny_server.url + "/v1/completions", content=body, headers={"content-type": ctype})
    assert_named(r, False, 415, "unsupported_media_type", None)
    for ok_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert httpx.post(tiny_server.url + "/v1/completions", content=body,
                          headers={"content-type": ok_type}).status_code == 200


# ------------------------------------------------------------------ request ids and the log

@pytest.mark.parametrize("given", ["abc status=500 path=/evil", 'x" injected="1', "a\tb", "x" * 129, "",
                                   "caf\xc3\xa9".encode("latin-1"), "id\u00e9".encode("utf-8")])
def test_hostile_request_ids_are_replaced_and_never_logged(tiny_server, given):
    r = httpx.post(tiny_server.url + "/v1/completions", json={"model": TINY_ID, "prompt": "Hi", "max_tokens": 1},
                   headers={"x-request-id": given})
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and re.fullmatch(r"req_[0-9a-f]{32}", rid)
    log = wait_for_log(tiny_server, f"request_id={rid} ")
    line = next(l for l in log.splitlines() if f"request_id={rid} " in l)
    fields = line.split("probity.server: ", 1)[1].split(" ")
    assert [f.split("=")[0] for f in fields] == ["request_id", "method", "path", "status", "duration_s"]
    assert fields[3] == "status=200"
    if isinstance(given, str) and given:
        assert given not in log


def test_a_plain_request_id_is_echoed_exactly(tiny_server):
    for rid in ("req-trace-42", "3f2a:9b.7_c/1+2", "x" * 128):
        r = tiny_server.get("/v1/models", headers={"x-request-id": rid})
        assert r.headers["x-request-id"] == rid


def test_a_hostile_path_cannot_add_log_fields(tiny_server):
    r = tiny_server.get("/v1/models/x%20status=999%20code=forged")
    assert r.status_code == 404
    line = wait_for_log(tiny_server, f"request_id={r.headers['x-request-id']} ").splitlines()[-1]
    assert "status=999" not in line and "code=forged" not in line and "status=404" in line


def wait_for_log(server, needle: str, within: float = 10.0) -> str:
    deadline = time.monotonic() + within
    while True:
        text = server.log_path.read_text(errors="replace")
        if needle in text or time.monotonic() > deadline:
            assert needle in text, needle
            return "\n".join(l for l in text.splitlines() if needle in l)
        time.sleep(0.05)


def test_host_guard_refusals_are_logged(tiny_server):
    r = tiny_server.get("/v1/models", headers={"Host": "attacker.example", "x-request-id": "host-guard-1"})
    assert_named(r, False, 400, "invalid_host", None)
    line = wait_for_log(tiny_server, "request_id=host-guard-1 ")
    assert "path=/v1/models status=400 code=invalid_host" in line


# ------------------------------------------------------------------ routes, methods, hosts

def test_a_trailing_slash_is_a_named_404_not_a_redirect(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/completions/", json={"model": TINY_ID, "prompt": "Hi"})
    assert_named(r, False, 404, "not_found", None)
    r = httpx.post(tiny_server.url + "/v1/messages/", json={})
    assert_named(r, True, 404, "not_found", None)


def test_405_names_the_allowed_methods(tiny_server):
    r = tiny_server.get("/v1/completions")
    assert_named(r, False, 405, "method_not_allowed", None)
    assert r.headers["allow"] == "POST"
    r = httpx.post(tiny_server.url + "/health")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}


@pytest.mark.parametrize("path", ["/health", "/v1/models", f"/v1/models/{TINY_ID}", "/tokenizer_info"])
def test_head_answers_like_get_without_a_body(tiny_server, path):
    r = httpx.head(tiny_server.url + path)
    assert r.status_code == 200 and r.content == b"" and r.headers["x-request-id"]


@pytest.mark.parametrize("host", ["LOCALHOST", "LocalHost:8000", "127.0.0.1:1"])
def test_host_names_are_case_insensitive(tiny_server, host):
    assert tiny_server.get("/v1/models", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/models/%00", "/v1/models/%ff%fe", "/v1/models/..%2f..%2fetc",
                                  "/%2e%2e/health", "/v1/models/" + "a" * 4000])
def test_hostile_paths_get_a_named_answer(tiny_server, path):
    r = tiny_server.get(path)
    assert r.status_code == 404 and r.json()["error"]["code"] in ("model_not_found", "not_found")


# ------------------------------------------------------------------ smaller deviations

def test_nested_field_errors_name_the_full_path(tiny_server):
    r = tiny_server.post("/v1/completions", json={"model": TINY_ID, "prompt": "Hi", "stream": True,
                                                  "stream_options": {"include_usage": "yes"}})
    assert_named(r, False, 400, "invalid_type", "stream_options.include_usage")


@pytest.mark.parametrize("message,param", [
    ({"content": "hi"}, "messages[0].role"), ({"role": "user"}, "messages[0].content"),
    ({"role": None, "content": "hi"}, "messages[0].role"),
])
def test_a_message_missing_a_field_is_missing_required_parameter(tiny_server, message, param):
    r = tiny_server.post("/v1/chat/completions", json={"model": TINY_ID, "messages": [message]})
    assert_named(r, False, 400, "missing_required_parameter", param)
    r = tiny_server.post("/v1/messages", json={"model": TINY_ID, "max_tokens": 2, "messages": [message]})
    assert_named(r, True, 400, "missing_required_parameter", param)


def test_tokenize_add_generation_prompt_is_checked_the_same_for_both_shapes(tiny_server):
    r = tiny_server.post("/tokenize", json={"prompt": "Hi", "add_generation_prompt": "banana"})
    assert_named(r, False, 400, "invalid_type", "add_generation_prompt")
    r = tiny_server.post("/tokenize", json={"prompt": "Hi", "add_generation_prompt": True})
    assert_named(r, False, 400, "invalid_value", "add_generation_prompt")
    a = tiny_server.post("/tokenize", json={"messages": USER, "add_generation_prompt": None})
    b = tiny_server.post("/tokenize", json={"messages": USER})
    assert a.status_code == 200 and a.json() == b.json()
    r = tiny_server.post("/tokenize", json={"messages": USER, "add_generation_prompt": "banana"})
    assert_named(r, False, 400, "invalid_type", "add_generation_prompt")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 6, "temperature": 0}),
])
def test_include_usage_chunks_say_usage_null_until_the_last(tiny_server, path, body):
    r = tiny_server.post(path, json={"model": TINY_ID, **body, "stream": True,
                                     "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert chunks and all("usage" in c and c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
    plain = sse_events(tiny_server.post(path, json={"model": TINY_ID, **body, "stream": True}).text)
    assert all("usage" not in c for c in plain[:-1])


def test_a_chat_token_cut_by_a_stop_string_reports_its_own_bytes(tiny_server, tiny_hf):
    """A multi-character token is forced (+100 bias at every step) and a stop string starts at its
    second character: the answer's text keeps its first character, and its logprobs entry keeps
    the whole token's bytes, label and value. The case is built, not searched for in whatever
    the greedy text happens to be."""
    _, tok = tiny_hf
    word = max((t for t in tok.get_vocab() if t.isascii() and t.isalpha() and len(t) >= 3 and t[:2] != t[1:3]),
               key=lambda t: (len(t), t))
    tid = tok.convert_tokens_to_ids(word)
    body = {"model": TINY_ID, "messages": USER, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "logit_bias": {str(tid): 100}}
    full = tiny_server.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = full["logprobs"]["content"]
    assert full["message"]["content"] == word * 6 and bytes(content[0]["bytes"]) == word.encode()
    stop = word[1:3]                       # first found at index 1: inside the first token
    cut = tiny_server.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == word[0]
    (last,) = cut["logprobs"]["content"]
    assert last["bytes"] == content[0]["bytes"] and last["token"] == content[0]["token"] == word
    assert last["logprob"] == content[0]["logprob"]


# ------------------------------------------------------------------ the engine client itself

def test_a_payload_that_cannot_be_framed_opens_no_channel():
    """Defence in depth under the body check: nothing is registered before the frame exists."""
    from probity.server.engine_client import EngineClient

    async def go():
        client = EngineClient("unused")
        client.state = "ready"
        with pytest.raises(UnicodeEncodeError):
            await client.submit({"op": "tokenize", "members": [{"text": S}]})
        return client.health()

    h = asyncio.run(go())
    assert (h["in_flight"], h["abandoned"]) == (0, 0)


def test_a_submit_beyond_its_frame_bound_is_a_named_413_and_opens_no_channel():
    """Reachable with a --max-body above 16 MiB: the request's size, named, before any write."""
    from probity.server.engine_client import EngineClient
    from probity.server.errors import APIError

    async def go():
        client = EngineClient("unused")
        client.state = "ready"
        with pytest.raises(APIError) as e:
            await client.submit({"op": "tokenize", "members": [{"text": "x" * (17 << 20)}]})
        assert (e.value.code, e.value.status) == ("request_too_large", 413)
        return client.health()

    h = asyncio.run(go())
    assert (h["in_flight"], h["abandoned"]) == (0, 0)


def raw_exchange(server, data: bytes) -> bytes:
    """Send raw bytes, read until the server closes (a reset raises)."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as c:
        c.sendall(data)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("head,status,code", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n", 400, "invalid_http_request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     400, "invalid_http_request"),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n", 400, "invalid_http_request"),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n", 431,
     "request_header_too_large"),
], ids=["bad-content-length", "two-content-lengths", "two-hosts", "200KB-header"])
def test_http_the_parser_refuses_gets_the_error_envelope_not_plain_text_or_a_reset(tiny_server, head, status, code):
    out = raw_exchange(tiny_server, head)
    status_line, _, rest = out.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status_line.startswith(b"HTTP/1.1 %d " % status), out[:200]
    assert b"content-type: application/json" in headers and b"x-request-id: req_" in headers
    assert json.loads(body)["error"]["code"] == code and CODES[code][0] == status
    nothing_in_flight(tiny_server)
