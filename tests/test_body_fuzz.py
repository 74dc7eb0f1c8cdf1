"""Hypothesis over JSON values for every field of every endpoint, over hostile raw bodies,
headers and paths: never a 5xx, every refusal a named error in the endpoint's own envelope,
and nothing left in flight in the engine client after any of it."""
from __future__ import annotations

import json
import re
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_ID
from probity.server.validation import CHAT_FIELDS, CHAT_REFUSED, COMPLETION_FIELDS, COMPLETION_REFUSED
from probity.server.anthropic_api import MESSAGE_FIELDS, MESSAGE_REFUSED

# text that may hold lone surrogates (hypothesis leaves them out unless asked)
texts = st.text(max_size=20) | st.text(st.characters(exclude_categories=()), max_size=6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12)

ENDPOINTS = {
    "/v1/completions": ({"model": TINY_ID, "prompt": "Hi", "max_tokens": 2},
                        sorted(COMPLETION_FIELDS | set(COMPLETION_REFUSED)), False),
    "/v1/chat/completions": ({"model": TINY_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                             sorted(CHAT_FIELDS | set(CHAT_REFUSED)), False),
    "/v1/messages": ({"model": TINY_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                     sorted(MESSAGE_FIELDS | set(MESSAGE_REFUSED)), True),
    "/v1/messages/count_tokens": ({"model": TINY_ID, "messages": [{"role": "user", "content": "Hi"}]},
                                  ["model", "messages", "system", "tools"], True),
    "/tokenize": ({"model": TINY_ID, "prompt": "Hi"}, ["model", "prompt", "messages", "add_special_tokens",
                                                       "add_generation_prompt"], False),
    "/detokenize": ({"model": TINY_ID, "tokens": [1, 2]}, ["model", "tokens"], False),
}


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, fields, anthropic = ENDPOINTS[path]
    body = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(fields + ["zz_unknown"]))
        if draw(st.integers(0, 9)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(json_values)
    if body.get("stream") is True:  # keep streamed answers short and readable in one go
        body["max_tokens"] = 2
    return path, body, anthropic


def post(server, path: str, data: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, content=data, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_answer(r: httpx.Response, anthropic: bool, param_required: bool = True) -> None:
    assert r.status_code < 500, r.text
    assert re.fullmatch(r"[A-Za-z0-9._:/+-]{1,128}", r.headers["x-request-id"])
    if r.status_code >= 400:
        j = r.json()
        if anthropic:
            assert j["type"] == "error" and set(j["error"]) == {"type", "message"} and j["error"]["message"]
        else:
            e = j["error"]
            assert set(e) == {"message", "type", "param", "code"} and e["code"], e
            assert e["param"] or not param_required, e


def assert_nothing_in_flight(server) -> None:
    deadline = time.monotonic() + 5  # a CANCEL's answer may still be on its way
    while True:
        e = server.get("/health").json()["engine"]
        if (e["in_flight"], e["abandoned"]) == (0, 0) or time.monotonic() > deadline:
            assert (e["in_flight"], e["abandoned"]) == (0, 0), e
            return
        time.sleep(0.02)


FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(bodies())
def test_fuzzed_bodies_never_5xx_and_refusals_are_named(tiny_server, case):
    path, body, anthropic = case
    # json.dumps writes a lone surrogate as its \udXXX escape: valid JSON, not text
    r = post(tiny_server, path, json.dumps(body).encode())
    assert_answer(r, anthropic, param_required=True)
    assert_nothing_in_flight(tiny_server)


@st.composite
def raw_bodies(draw):
    """A valid body spoiled at the byte level the way hostile clients do."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, fields, anthropic = ENDPOINTS[path]
    text = json.dumps(base)
    how = draw(st.sampled_from(["nan", "infinity", "duplicate", "bom", "utf8", "deep", "surrogate", "truncate",
                                "trailing", "key_surrogate"]))
    field = draw(st.sampled_from(fields))
    if how == "nan":
        text = text[:-1] + f', "{field}": NaN}}'
    elif how == "infinity":
        text = text[:-1] + f', "{field}": {draw(st.sampled_from(["Infinity", "-Infinity"]))}}}'
    elif how == "duplicate":
        text = text[:-1] + f', "model": {json.dumps(base.get("model", "x"))}}}'
    elif how == "deep":
        d = draw(st.integers(60, 20_000))
        text = text[:-1] + f', "{field}": {"[" * d}{"]" * d}}}'
    elif how == "surrogate":
        text = text[:-1] + f', "{field}": "x\\u{draw(st.integers(0xD800, 0xDFFF)):04x}y"}}'
    elif how == "key_surrogate":
        text = "{" + f'"\\u{draw(st.integers(0xD800, 0xDFFF)):04x}": 1, ' + text[1:]
    elif how == "truncate":
        text = text[: draw(st.integers(0, len(text) - 1))]
    elif how == "trailing":
        text = text + draw(st.sampled_from(["x", "{}", " 1", "\x00"]))
    data = text.encode()
    if how == "bom":
        data = b"\xef\xbb\xbf" + data
    elif how == "utf8":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])) + data[at:]
    return path, data, anthropic


@settings(FUZZ, max_examples=100)
@given(raw_bodies())
def test_hostile_raw_bodies_get_a_named_4xx(tiny_server, case):
    path, data, anthropic = case
    r = post(tiny_server, path, data)
    assert 400 <= r.status_code < 500 or r.status_code == 200, r.text
    assert_answer(r, anthropic, param_required=False)
    assert_nothing_in_flight(tiny_server)


header_values = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00")) | st.sampled_from(
    [b"abc status=500 path=/evil", b"caf\xc3\xa9", b"\xff\xfe", b" ", b"a" * 300, b"LOCALHOST", b"[::1]:80",
     b"127.0.0.1:99999", b"Bearer \xff", b"text/plain", b"application/json; charset=latin-1"])
paths = st.sampled_from(["/v1/completions", "/v1/messages", "/tokenize", "/v1/models/x", "/health"]).flatmap(
    lambda p: st.text(st.sampled_from("abc/.%20%00%ff%2e%2F?#=&\"'<>"), max_size=12).map(lambda t: p + t))


@settings(FUZZ, max_examples=100)
@given(paths, st.dictionaries(st.sampled_from(["x-request-id", "host", "content-type", "authorization",
                                               "x-api-key", "content-length-x", "anthropic-version"]),
                              header_values, max_size=3),
       st.sampled_from(["GET", "POST", "HEAD", "PUT", "OPTIONS"]))
def test_hostile_headers_and_paths_get_a_named_answer(tiny_server, path, headers, method):
    body = json.dumps({"model": TINY_ID, "prompt": "Hi", "max_tokens": 1}).encode() if method == "POST" else None
    try:
        r = httpx.request(method, tiny_server.url + path, content=body, headers=headers, timeout=60)
    except (httpx.LocalProtocolError, httpx.InvalidURL, httpx.UnsupportedProtocol):
        return  # the client itself would not send this
    assert r.status_code < 500, r.text
    assert re.fullmatch(r"[A-Za-z0-9._:/+-]{1,128}", r.headers["x-request-id"])
    if r.status_code >= 400 and method != "HEAD":
        assert r.headers["content-type"] == "application/json"
        j = r.json()
        assert ("error" in j and "code" in j["error"]) or (j.get("type") == "error")
    assert_nothing_in_flight(tiny_server)
