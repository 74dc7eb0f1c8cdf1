"""Hypothesis over JSON values for every field of every endpoint: never a 5xx, every refusal a
named error in the endpoint's own envelope."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_ID
from probity.server.validation import CHAT_FIELDS, CHAT_REFUSED, COMPLETION_FIELDS, COMPLETION_REFUSED
from probity.server.anthropic_api import MESSAGE_FIELDS, MESSAGE_REFUSED

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
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


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies())
def test_fuzzed_bodies_never_5xx_and_refusals_are_named(tiny_server, case):
    path, body, anthropic = case
    r = tiny_server.post(path, json=body, timeout=120)
    assert r.status_code < 500, (path, body, r.text)
    assert r.headers["x-request-id"]
    if r.status_code >= 400:
        j = r.json()
        if anthropic:
            assert j["type"] == "error" and set(j["error"]) == {"type", "message"} and j["error"]["message"]
        else:
            e = j["error"]
            assert set(e) == {"message", "type", "param", "code"} and e["code"] and e["param"], (body, e)
