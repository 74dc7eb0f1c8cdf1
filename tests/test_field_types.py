"""Every field of every endpoint gets every JSON type — true, false, 0, 1, 1.0, "", [], {},
null — and, for numeric fields, a value just out of range, on an otherwise valid minimal
request. The expected answer comes from docs/api.md's rule for that field (the tables below are
written from the doc, not from the code): a 200, or the documented status with the exact `code`
and `param` in the endpoint's own envelope. Python's `0 == False`, `1 == True` and `1.0 == 1`
make this family of bug invisible to tests that only send the "usual" values."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import pytest

from conftest import ROOT, TINY_ID

# The error table of docs/api.md: code -> (status, OpenAI type, Anthropic type).
ERRORS = {m[1]: (int(m[2]), m[3], m[4]) for m in re.finditer(
    r"^\| `(\w+)` \| (\d{3}) \| (\w+) \| (\w+|—) \|", (ROOT / "docs/api.md").read_text(), re.M)}

VALUES: list[tuple[str, Any]] = [("true", True), ("false", False), ("0", 0), ("1", 1), ("1.0", 1.0),
                                 ('""', ""), ("[]", []), ("{}", {}), ("null", None)]

OK = "ok"
T, V, MISSING, UNSUPPORTED, REFUSED = ("invalid_type", "invalid_value", "missing_required_parameter",
                                       "unsupported_value", "unsupported_parameter")


@dataclass(frozen=True)
class Model:
    vocab: int
    ctx: int


Rule = Callable[[Any, Model], "str | tuple[str, str]"]   # a value -> OK, a code, or (code, param)


def is_int(v) -> bool:
    return type(v) is int          # JSON true is never an integer, 1.0 is not one either


def is_num(v) -> bool:
    return type(v) in (int, float)


# ------------------------------------------------------------------ rules, as docs/api.md words them

def integer(lo, hi, null=OK) -> Rule:
    def rule(v, m):
        if v is None:
            return null
        if not is_int(v):
            return T
        return OK if _at(lo, m) <= v <= _at(hi, m) else V
    return rule


def number(lo, hi, lo_open=False, null=OK) -> Rule:
    def rule(v, m):
        if v is None:
            return null
        if not is_num(v):
            return T
        return OK if (lo < v if lo_open else lo <= v) and v <= hi else V
    return rule


def boolean(null=OK) -> Rule:
    return lambda v, m: null if v is None else OK if type(v) is bool else T


def string(null=OK, empty=OK) -> Rule:
    return lambda v, m: null if v is None else (empty if v == "" else OK) if type(v) is str else T


def obj(null=OK, empty=OK) -> Rule:
    return lambda v, m: null if v is None else (empty if not v else OK) if type(v) is dict else T


def strings(bare: bool) -> Rule:
    """stop / stop_sequences: an array of at most 32 non-empty strings (or, for `stop`, one string)."""
    def rule(v, m):
        if v is None:
            return OK
        if bare and type(v) is str:
            return OK if v else V
        if type(v) is not list:
            return T
        return OK if len(v) <= 32 else V
    return rule


def refused(v, m):
    return OK if v is None else REFUSED


def unknown(v, m):
    return "unknown_parameter"


def model_field(required=True) -> Rule:
    def rule(v, m):
        if v is None:
            return MISSING if required else OK
        if type(v) is not str:
            return T
        return OK if v == TINY_ID else "model_not_found"
    return rule


def _at(bound, m: Model) -> int:
    return bound(m) if callable(bound) else bound


def vocab(m):
    return m.vocab


@dataclass
class Case:
    endpoint: str
    base: dict
    field: tuple            # path into the body
    rule: Rule
    param: str | None = None              # the documented param; default: the field's own path
    edges: tuple = ()                     # (label, value or fn(Model)) just out of range
    anthropic: bool = False
    sweep: bool = True                    # False: only the edges are sent
    shows: Callable[[Any, Any], bool] | None = None   # (value, answer body) -> the 200 does what was asked


HI = [{"role": "user", "content": "Hi"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
CMPL = {"model": TINY_ID, "prompt": "Hi", "max_tokens": 1}
CHAT = {"model": TINY_ID, "messages": HI, "max_tokens": 1}
MSG = {"model": TINY_ID, "messages": HI, "max_tokens": 1}
COUNT = {"model": TINY_ID, "messages": HI}
TOK_P = {"model": TINY_ID, "prompt": "Hi"}
TOK_M = {"model": TINY_ID, "messages": HI}
DETOK = {"model": TINY_ID, "tokens": [1, 2]}
INT64 = (-(2**63), 2**63 - 1)
JUST_ABOVE = 1e-6


def num_edges(lo, hi, lo_open=False):
    return (("below", lo if lo_open else lo - JUST_ABOVE), ("above", hi + JUST_ABOVE))


def int_edges(lo, hi):
    return (("below", (lambda m: _at(lo, m) - 1)), ("above", (lambda m: _at(hi, m) + 1)))


def sampling(endpoint: str, base: dict) -> list[Case]:
    """The sampling fields /v1/completions and /v1/chat/completions share ("as for completions")."""
    return [
        Case(endpoint, base, ("temperature",), number(0, 2), edges=num_edges(0, 2)),
        Case(endpoint, base, ("top_p",), number(0, 1, lo_open=True), edges=num_edges(0, 1, lo_open=True)),
        Case(endpoint, base, ("top_k",), integer(-1, vocab), edges=int_edges(-1, vocab)),
        Case(endpoint, base, ("n",), integer(1, 16), edges=int_edges(1, 16)),
        Case(endpoint, base, ("stop",), strings(bare=True), edges=(("33 strings", [f"s{i}" for i in range(33)]),)),
        Case(endpoint, {**base, "stop": ["zz"]}, ("stop", 0), string(null=T, empty=V)),
        Case(endpoint, base, ("presence_penalty",), number(-2, 2), edges=num_edges(-2, 2)),
        Case(endpoint, base, ("frequency_penalty",), number(-2, 2), edges=num_edges(-2, 2)),
        Case(endpoint, base, ("logit_bias",), lambda v, m: V if type(v) is dict and len(v) > 1024 else obj()(v, m),
             edges=(("1025 entries", {str(i): 1 for i in range(1025)}),)),
        Case(endpoint, {**base, "logit_bias": {"1": 0}}, ("logit_bias", "1"), number(-100, 100, null=T),
             edges=num_edges(-100, 100)),
        Case(endpoint, base, ("seed",), integer(*INT64), edges=int_edges(*INT64)),
        Case(endpoint, base, ("stream",), boolean()),
        # type-checked first; an object is only allowed with stream: true
        Case(endpoint, base, ("stream_options",), lambda v, m: OK if v is None else V if type(v) is dict else T),
        Case(endpoint, {**base, "stream": True, "stream_options": {}}, ("stream_options", "include_usage"),
             boolean(), shows=lambda v, text: ('"choices":[],"usage":{' in text) == (v is True)),
        Case(endpoint, base, ("user",), string()),
        Case(endpoint, base, ("zz_unknown",), unknown),
    ]


def message_cases(endpoint: str, base: dict, roles: tuple[str, ...], anthropic: bool = False) -> list[Case]:
    def role(v, m):
        if v is None:
            return MISSING
        return (OK if v in roles else UNSUPPORTED) if type(v) is str else T

    def content(v, m):
        if v is None:
            return MISSING
        return OK if type(v) in (str, list) else T   # "" and [] are empty text

    def part_type(v, m):
        if v is None:
            return MISSING
        return (OK if v == "text" else UNSUPPORTED) if type(v) is str else T

    return [
        Case(endpoint, base, ("messages",), lambda v, m: MISSING if v is None else (V if v == [] else T),
             anthropic=anthropic),
        Case(endpoint, base, ("messages", 0),
             lambda v, m: (MISSING, "messages[0].role") if type(v) is dict else T, anthropic=anthropic),
        Case(endpoint, base, ("messages", 0, "role"), role, anthropic=anthropic),
        Case(endpoint, base, ("messages", 0, "content"), content, anthropic=anthropic),
        Case(endpoint, {**base, "messages": PARTS}, ("messages", 0, "content", 0),
             lambda v, m: (MISSING, "messages[0].content[0].type") if type(v) is dict else T,
             anthropic=anthropic),
        Case(endpoint, {**base, "messages": PARTS}, ("messages", 0, "content", 0, "type"), part_type,
             anthropic=anthropic),
        Case(endpoint, {**base, "messages": PARTS}, ("messages", 0, "content", 0, "text"), string(null=MISSING),
             anthropic=anthropic),
    ]


def constrained_logprobs(v, m):   # a boolean; true needs a grammar, which these bodies do not have
    return OK if v is None or v is False else V if v is True else T


def completions() -> list[Case]:
    e = "/v1/completions"

    def prompt(v, m):
        if v is None:
            return MISSING
        if v == []:
            return V
        return OK if type(v) is str and v else V if v == "" else T

    def prompt_member(v, m):   # ["Hi"] with member 0 replaced
        if is_int(v):
            return OK          # a flat token-id prompt
        if v == "" or v == []:
            return V           # an empty prompt has no token to condition on
        return OK if type(v) is str else T

    def logprobs(v, m):
        if v is None or v is False:
            return OK
        return (OK if 0 <= v <= 32 else V) if is_int(v) else T

    return [
        Case(e, CMPL, ("model",), model_field()),
        Case(e, CMPL, ("prompt",), prompt),
        Case(e, {**CMPL, "prompt": ["Hi"]}, ("prompt", 0), prompt_member),
        Case(e, CMPL, ("max_tokens",), lambda v, m: OK if v is None else V if v == 0 and is_int(v)
             else integer(0, 1 << 24)(v, m), edges=int_edges(0, 1 << 24)),
        Case(e, CMPL, ("max_tokens",), lambda v, m: "context_length_exceeded", param="prompt", sweep=False,
             edges=(("prompt + max_tokens > window", lambda m: m.ctx),)),
        Case(e, {**CMPL, "echo": True}, ("max_tokens",), integer(0, 1 << 24)),
        *sampling(e, CMPL),
        Case(e, CMPL, ("logprobs",), logprobs, edges=int_edges(0, 32),
             shows=lambda v, a: (a["choices"][0]["logprobs"] is None) == (v is None or v is False or v == 0)),
        Case(e, CMPL, ("echo",), boolean(null=T), shows=lambda v, a: a["choices"][0]["text"].startswith("Hi") or not v),
        Case(e, CMPL, ("return_tokens_as_token_ids",), boolean()),
        Case(e, CMPL, ("group_score",), lambda v, m: OK if v is None or v is False else UNSUPPORTED),
        Case(e, CMPL, ("constrained_logprobs",), constrained_logprobs),
        Case(e, CMPL, ("structured_outputs",), obj(empty=V)),
        Case(e, CMPL, ("response_format",), lambda v, m: (MISSING, "response_format.type") if v == {}
             else obj()(v, m)),
        Case(e, CMPL, ("best_of",), refused),
        Case(e, CMPL, ("suffix",), refused),
    ]


def chat() -> list[Case]:
    e = "/v1/chat/completions"

    def top_logprobs(v, m):   # without logprobs: true, only 0 is allowed
        if v is None:
            return OK
        return (OK if v == 0 else V) if is_int(v) else T

    def response_format_type(v, m):
        if v is None:
            return MISSING
        return (OK if v == "text" else UNSUPPORTED) if type(v) is str else T

    refused_fields = ["echo", "functions", "function_call", "audio",
                      "modalities", "prediction", "reasoning_effort", "web_search_options", "best_of", "suffix"]

    def tools(v, m):          # an array of at least one tool
        return OK if v is None else (V if v == [] else OK) if type(v) is list else T

    def tool_choice(v, m):    # without tools: only none and auto; a string or an object
        if v is None:
            return OK
        if type(v) not in (str, dict):
            return T
        return OK if v in ("none", "auto") else V
    no_max = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    return [
        Case(e, CHAT, ("model",), model_field()),
        *message_cases(e, CHAT, ("system", "developer", "user", "assistant")),
        Case(e, CHAT, ("max_tokens",), integer(1, 1 << 24), edges=int_edges(1, 1 << 24)),
        Case(e, no_max, ("max_completion_tokens",), integer(1, 1 << 24), edges=int_edges(1, 1 << 24)),
        Case(e, CHAT, ("max_tokens",), lambda v, m: "context_length_exceeded", param="messages", sweep=False,
             edges=(("prompt + max_tokens > window", lambda m: m.ctx),)),
        *sampling(e, CHAT),
        Case(e, CHAT, ("logprobs",), boolean(),
             shows=lambda v, a: (a["choices"][0]["logprobs"] is None) == (v is not True)),
        Case(e, CHAT, ("top_logprobs",), top_logprobs, edges=int_edges(0, 32)),
        Case(e, {**CHAT, "logprobs": True}, ("top_logprobs",), integer(0, 32), edges=int_edges(0, 32),
             shows=lambda v, a: len(a["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == (v or 0)),
        Case(e, CHAT, ("response_format",), lambda v, m: (MISSING, "response_format.type") if v == {}
             else obj()(v, m)),
        Case(e, {**CHAT, "response_format": {"type": "text"}}, ("response_format", "type"), response_format_type),
        *[Case(e, CHAT, (f,), refused) for f in refused_fields],
        Case(e, CHAT, ("tools",), tools),
        Case(e, CHAT, ("tool_choice",), tool_choice),
        Case(e, CHAT, ("parallel_tool_calls",), boolean()),
        Case(e, CHAT, ("structured_outputs",), obj(empty=V)),
        Case(e, CHAT, ("prompt_logprobs",), integer(0, 32), edges=int_edges(0, 32)),
        Case(e, CHAT, ("constrained_logprobs",), constrained_logprobs),
    ]


def anthropic_tools(v, m):
    return OK if v is None else (V if v == [] else OK) if type(v) is list else T


def anthropic_tool_choice(v, m):   # without tools: only {type: auto} or {type: none}
    return OK if v is None else V if type(v) is dict else T


def messages() -> list[Case]:
    e = "/v1/messages"

    return [
        Case(e, MSG, ("model",), model_field(), anthropic=True),
        Case(e, MSG, ("max_tokens",), integer(1, 1 << 24, null=MISSING), edges=int_edges(1, 1 << 24),
             anthropic=True),
        Case(e, MSG, ("max_tokens",), lambda v, m: "context_length_exceeded", param="messages", sweep=False,
             edges=(("prompt + max_tokens > window", lambda m: m.ctx),), anthropic=True),
        *message_cases(e, MSG, ("user", "assistant"), anthropic=True),
        Case(e, MSG, ("system",), lambda v, m: OK if v is None or type(v) in (str, list) else T, anthropic=True),
        Case(e, {**MSG, "system": [{"type": "text", "text": "Be brief."}]}, ("system", 0, "text"),
             string(null=MISSING), anthropic=True),
        Case(e, MSG, ("stop_sequences",), strings(bare=False),
             edges=(("33 strings", [f"s{i}" for i in range(33)]),), anthropic=True),
        Case(e, {**MSG, "stop_sequences": ["zz"]}, ("stop_sequences", 0), string(null=T, empty=V), anthropic=True),
        Case(e, MSG, ("temperature",), number(0, 1), edges=num_edges(0, 1), anthropic=True),
        Case(e, MSG, ("top_p",), number(0, 1, lo_open=True), edges=num_edges(0, 1, lo_open=True), anthropic=True),
        Case(e, MSG, ("top_k",), integer(0, vocab), edges=int_edges(0, vocab), anthropic=True),
        Case(e, MSG, ("stream",), boolean(), anthropic=True),
        Case(e, MSG, ("metadata",), obj(), anthropic=True),
        Case(e, {**MSG, "metadata": {}}, ("metadata", "user_id"), string(), anthropic=True),
        *[Case(e, MSG, (f,), refused, anthropic=True)
          for f in ("thinking", "mcp_servers", "container", "service_tier")],
        Case(e, MSG, ("tools",), anthropic_tools, anthropic=True),
        Case(e, MSG, ("tool_choice",), anthropic_tool_choice, anthropic=True),
        Case(e, MSG, ("zz_unknown",), unknown, anthropic=True),
    ]


def count_tokens() -> list[Case]:
    e = "/v1/messages/count_tokens"
    return [
        Case(e, COUNT, ("model",), model_field(), anthropic=True),
        *message_cases(e, COUNT, ("user", "assistant"), anthropic=True),
        Case(e, COUNT, ("system",), lambda v, m: OK if v is None or type(v) in (str, list) else T, anthropic=True),
        Case(e, COUNT, ("thinking",), refused, anthropic=True),
        Case(e, COUNT, ("tools",), anthropic_tools, anthropic=True),
        Case(e, COUNT, ("tool_choice",), anthropic_tool_choice, anthropic=True),
        Case(e, COUNT, ("max_tokens",), unknown, anthropic=True),
    ]


def tokenizer() -> list[Case]:
    def one_of(v, m):   # prompt/messages removed: exactly one must be given
        return MISSING if v is None else T

    def tokens_member(v, m):
        if not is_int(v):
            return T
        return OK if 0 <= v < m.vocab else "token_out_of_vocabulary"

    return [
        Case("/tokenize", TOK_P, ("model",), model_field(required=False)),
        Case("/tokenize", TOK_P, ("prompt",), lambda v, m: MISSING if v is None else OK if type(v) is str else T),
        Case("/tokenize", TOK_P, ("add_special_tokens",), boolean()),
        # a boolean, and one that applies to messages only: no template is rendered for a raw prompt
        Case("/tokenize", TOK_P, ("add_generation_prompt",), lambda v, m: V if type(v) is bool else boolean()(v, m)),
        Case("/tokenize", TOK_P, ("messages",), lambda v, m: OK if v is None else V, param="prompt"),
        *[c for c in message_cases("/tokenize", TOK_M, ("system", "developer", "user", "assistant"))
          if c.field != ("messages",)],
        Case("/tokenize", TOK_M, ("messages",),
             lambda v, m: (MISSING, "prompt") if v is None else (V if v == [] else T)),
        Case("/tokenize", TOK_M, ("add_special_tokens",), lambda v, m: UNSUPPORTED if v is True else boolean()(v, m)),
        Case("/tokenize", TOK_M, ("add_generation_prompt",),
             lambda v, m: UNSUPPORTED if v is False else boolean()(v, m)),
        Case("/tokenize", TOK_P, ("zz_unknown",), unknown),
        Case("/detokenize", DETOK, ("model",), model_field(required=False)),
        Case("/detokenize", DETOK, ("tokens",), lambda v, m: MISSING if v is None else OK if v == [] else T,
             shows=lambda v, a: a == {"prompt": ""}),
        Case("/detokenize", DETOK, ("tokens", 0), tokens_member, param="tokens",
             edges=(("-1", -1), ("vocab_size", vocab))),
        Case("/detokenize", DETOK, ("zz_unknown",), unknown),
    ]


CASES = [*completions(), *chat(), *messages(), *count_tokens(), *tokenizer()]


def _path(field: tuple) -> str:
    """("messages", 0, "role") -> "messages[0].role", the form docs/api.md names params in."""
    out = ""
    for k in field:
        out += f"[{k}]" if type(k) is int else (f".{k}" if out else k)
    return out


def _case_id(c: Case) -> str:
    extra = ",".join(f"{k}={json.dumps(v)}" for k, v in c.base.items() if k not in ("model", "messages", "prompt",
                                                                                    "max_tokens", "tokens"))
    given = "+".join(k for k in ("prompt", "messages") if k in c.base) if c.endpoint == "/tokenize" else ""
    return (f"{c.endpoint}{f' ({given})' if given else ''} {_path(c.field)}" + (f" [{extra}]" if extra else "")
            + ("" if c.sweep else " edge"))


def _with(body: dict, path: tuple, value: Any) -> dict:
    out = json.loads(json.dumps(body))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:   # one connection: ~1000 requests
        yield c


@pytest.fixture(scope="module")
def model(tiny_server) -> Model:
    info = tiny_server.get("/tokenizer_info").json()
    return Model(vocab=info["vocab_size"], ctx=info["max_model_len"])


def _answer(r, case: Case, value: Any, expected_code: str, param: str) -> str | None:
    """None when the response matches the documented outcome, else what is wrong."""
    if expected_code == OK:
        if r.status_code != 200:
            return f"expected 200, got {r.status_code} {r.text[:200]}"
        stream = r.headers["content-type"].startswith("text/event-stream")
        if stream and ("event: message_stop" if case.anthropic else "data: [DONE]") not in r.text:
            return f"stream did not finish: {r.text[-200:]}"
        if case.shows and not case.shows(value, r.text if stream else r.json()):
            return f"200 does not do what was asked: {r.text[:300]}"
        return None
    status, openai_type, anthropic_type = ERRORS[expected_code]
    got = f"{r.status_code} {r.text[:300]}"
    if r.status_code != status:
        return f"expected {status} {expected_code} on {param!r}, got {got}"
    j = r.json()
    if case.anthropic:
        if set(j) != {"type", "error"} or j["type"] != "error" or set(j["error"]) != {"type", "message"}:
            return f"not the Anthropic envelope: {got}"
        if j["error"]["type"] != anthropic_type or not j["error"]["message"].startswith(f"{param}: "):
            return f"expected {anthropic_type} naming {param!r}, got {got}"
        return None
    e = j.get("error")
    if type(e) is not dict or set(e) != {"message", "type", "param", "code"}:
        return f"not the OpenAI envelope: {got}"
    if (e["code"], e["param"], e["type"]) != (expected_code, param, openai_type):
        return f"expected {expected_code} on {param!r}, got {got}"
    return None


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_json_type_gets_the_documented_answer(client, model, case: Case):
    probes = (VALUES if case.sweep else []) + [(label, v(model) if callable(v) else v) for label, v in case.edges]
    wrong = []
    for label, v in probes:
        expected = case.rule(v, model)
        code, param = expected if type(expected) is tuple else (expected, case.param or _path(case.field))
        r = client.post(case.endpoint, json=_with(case.base, case.field, v))
        problem = _answer(r, case, v, code, param)
        if problem:
            wrong.append(f"{param} = {label}: {problem}")
    assert not wrong, "\n".join(wrong)


def test_nothing_is_left_in_flight_after_the_sweep(tiny_server):
    h = tiny_server.get("/health").json()
    assert h["status"] == "ok" and h["active"] == 0 and h["queued"] == 0
    assert h["engine"]["in_flight"] == 0 and h["engine"]["abandoned"] == 0


# ------------------------------------------------------------------ what a sweep of small values cannot reach

def _raw(client, path: str, text: str):
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
def test_a_number_beyond_float_range_is_out_of_range_not_a_server_error(client, field):
    for literal in ("1" + "0" * 400, "-1" + "0" * 400, "1e400"):   # math.isfinite(10**400) raises
        r = _raw(client, "/v1/completions", f'{{"model": "{TINY_ID}", "prompt": "Hi", "max_tokens": 1, '
                                            f'"{field}": {literal}}}')
        assert r.status_code == 400, (literal, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value", field)
    r = _raw(client, "/v1/completions", f'{{"model": "{TINY_ID}", "prompt": "Hi", "max_tokens": 1, '
                                        f'"logit_bias": {{"1": 1{"0" * 400}}}}}')
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (400, "invalid_value",
                                                                                   "logit_bias.1")


def test_logit_bias_keys_that_name_one_token_twice_are_refused(client):
    body = {"model": TINY_ID, "prompt": "Hi", "max_tokens": 1}
    r = client.post("/v1/completions", json={**body, "logit_bias": {"1": 100, "01": -100}})
    assert r.status_code == 400 and (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value",
                                                                                             "logit_bias")
    for key in ("01", "0" * 5000 + "1"):   # token 1, however written
        assert client.post("/v1/completions", json={**body, "logit_bias": {key: 5}}).status_code == 200
    for key in ("9" * 5000, "1.0", "-1", "", "x"):   # int() refuses > 4300 digits: not a 500 either
        r = client.post("/v1/completions", json={**body, "logit_bias": {key: 1}})
        assert r.status_code == 400, (key[:10], r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("token_out_of_vocabulary", "logit_bias")


def test_response_format_takes_only_the_type_key(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text", "strict": True}})
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (400, "unknown_parameter",
                                                                                   "response_format.strict")
