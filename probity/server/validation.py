"""Request bodies -> one typed object each, or a named APIError. Everything downstream trusts
the result. Every accepted field is listed in docs/api.md with its range."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from .. import protocol as P
from ..protocol import Sampling
from .errors import APIError
from .fields import (bad_type, bad_value, boolean, check_keys, integer, is_int, is_num, missing_field, model_field, number,
                     stop_field, token_ids)
from .grammar_check import GrammarCheck
from .structured import response_format, structured_outputs
from .tools import Tools, parse_tools


@dataclass
class Limits:
    """Configurable bounds (CLI flags); documented in docs/api.md."""
    max_logprobs: int = P.MAX_LOGPROBS
    max_members: int = 128
    batch_prompt_tokens: int = 65536
    batch_completion_tokens: int = 65536
    max_response_bytes: int = 64 << 20  # engine frames one non-streamed response may assemble
    grammar: GrammarCheck = field(default_factory=GrammarCheck)  # grammar bounds and the compile worker


GRAMMAR_FIELDS = ("response_format", "structured_outputs", "tools")


async def off_loop(parse, body: dict, *args):
    """parse(body, *args), in a thread where the body holds a grammar: its compile check waits
    on the grammar worker, and the event loop (every other route) must not wait with it."""
    if any(body.get(k) is not None for k in GRAMMAR_FIELDS):
        return await run_in_threadpool(parse, body, *args)
    return parse(body, *args)


@dataclass
class CompletionRequest:
    model: str
    members: list[dict]            # each {"text": str} or {"ids": [int]}
    is_array: bool
    sampling: Sampling             # .logprobs None: no logprobs object
    stream: bool
    include_usage: bool
    token_ids_labels: bool
    grammar_param: str | None = None   # the field its grammar came from (an engine refusal of it names this)


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]           # {"role", "content": str, tool_calls?, tool_call_id?}: the SUBMIT's
    sampling: Sampling             # .logprobs: top_logprobs when logprobs is true, else None
    stream: bool
    include_usage: bool
    tools: Tools | None = None
    prompt_logprobs: int | None = None
    top_logprobs: int | None = None  # the completion's own tables (logprobs: true), None: none
    grammar_param: str | None = None   # the field its grammar came from (an engine refusal of it names this)


# ------------------------------------------------------------------ field helpers

def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if type(v) is not dict:
        raise bad_type("logit_bias", "an object mapping token ids to numbers")
    if len(v) > P.MAX_LOGIT_BIAS:
        raise bad_value("logit_bias", f"at most {P.MAX_LOGIT_BIAS} entries")
    lo, hi = P.LOGIT_BIAS
    out: dict[int, float] = {}
    for k, b in v.items():
        digits = k.lstrip("0") or "0"
        # The length test keeps int() away from keys beyond its 4300-digit limit (a 500).
        if not (k.isascii() and k.isdigit()) or len(digits) > len(str(vocab_size)) or int(digits) >= vocab_size:
            raise APIError("token_out_of_vocabulary", f"logit_bias key {k!r} is not a token id below {vocab_size}", "logit_bias")
        if int(digits) in out:  # "1" and "01" name one token: never let one bias silently replace the other
            raise APIError("invalid_value", f"logit_bias names token {digits} twice", "logit_bias")
        p = f"logit_bias.{k}"
        if not is_num(b):
            raise bad_type(p, "a number")
        if not lo <= b <= hi:
            raise bad_value(p, f"in [{lo:g}, {hi:g}]")
        out[int(digits)] = float(b)
    return out


def _row_fields(body: dict, vocab_size: int) -> dict[str, Any]:
    """distribution and score_tokens (probity's extensions), as Sampling's keyword arguments.
    A score_tokens string is resolved to its token by the engine (it holds the vocabulary)."""
    distribution = boolean(body, "distribution", False)
    v = body.get("score_tokens")
    if v is None:
        return dict(distribution=distribution)
    what = f"an array of 1 to {P.MAX_SCORE_TOKENS} token ids or one-token strings"
    if type(v) is not list or not v:
        raise bad_type("score_tokens", what)
    if len(v) > P.MAX_SCORE_TOKENS:
        raise bad_value("score_tokens", what)
    for j, t in enumerate(v):
        where = f"score_tokens[{j}]"
        if type(t) is int:
            if not 0 <= t < vocab_size:
                raise bad_value(where, f"a token id in [0, {vocab_size})")
        elif type(t) is str:
            if not 1 <= len(t) <= P.MAX_SCORE_TEXT:
                raise bad_value(where, f"a string of 1 to {P.MAX_SCORE_TEXT} characters (one token's text)")
        else:
            raise bad_type(where, "a token id or a one-token string")
    return dict(distribution=distribution, score_tokens=tuple(v))


def _sampling(body: dict, vocab_size: int) -> dict[str, Any]:
    """The sampling fields completions and chat share, as Sampling's keyword arguments."""
    top_k = integer(body, "top_k", 0, -1, vocab_size)
    return dict(
        temperature=number(body, "temperature", 1.0, *P.TEMPERATURE),
        top_p=number(body, "top_p", 1.0, *P.TOP_P, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        n=integer(body, "n", 1, 1, P.MAX_CHOICES),
        stop=tuple(stop_field(body)),
        presence_penalty=number(body, "presence_penalty", 0.0, *P.PENALTY),
        frequency_penalty=number(body, "frequency_penalty", 0.0, *P.PENALTY),
        logit_bias=_logit_bias(body, vocab_size),
        seed=integer(body, "seed", None, *P.SEED),
        cache_salt=_cache_salt(body))


def _cache_salt(body: dict) -> str | None:
    """vLLM's cache_salt: the prefix cache shares this request's prompt blocks only with requests
    that send the same salt (a non-empty string; null: the shared, unsalted cache)."""
    v = body.get("cache_salt")
    if v is None:
        return None
    if type(v) is not str:
        raise bad_type("cache_salt", "a string")
    if not 1 <= len(v) <= P.MAX_CACHE_SALT:
        raise bad_value("cache_salt", f"a non-empty string of at most {P.MAX_CACHE_SALT} characters")
    return v


def _stream(body: dict) -> tuple[bool, bool]:
    stream = boolean(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if type(opts) is not dict:  # the type first, as for every field, then the consistency
        raise bad_type("stream_options", "an object")
    if not stream:
        raise APIError("invalid_value", "'stream_options' is only allowed with stream: true", "stream_options")
    for k in opts:
        if k != "include_usage":
            raise APIError("unknown_parameter", f"unknown parameter 'stream_options.{k}'", f"stream_options.{k}")
    return stream, boolean(opts, "include_usage", False, where="stream_options.")


# ------------------------------------------------------------------ completions

COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "presence_penalty",
    "frequency_penalty", "logit_bias", "seed", "logprobs", "echo", "stream", "stream_options",
    "user", "return_tokens_as_token_ids", "group_score", "response_format", "structured_outputs",
    "constrained_logprobs", "distribution", "score_tokens", "cache_salt",
}
COMPLETION_REFUSED = {
    "best_of": "generate n choices instead and rank them client-side",
    "suffix": "insertion (fill-in-the-middle) is not supported",
}


def parse_completion(body: dict, served: str, vocab_size: int, limits: Limits) -> CompletionRequest:
    # Reserved for a future opt-in that changes the response shape: refuse before anything else.
    # `is`, not `in (None, False)`: 0 == False in Python, and 0 is not an accepted value.
    gs = body.get("group_score")
    if gs is not None and gs is not False:
        raise APIError("unsupported_value", "'group_score' is reserved; only null or false are accepted", "group_score")
    check_keys(body, COMPLETION_FIELDS, COMPLETION_REFUSED)
    model = model_field(body, served)
    members, is_array = _prompt(body, vocab_size)
    if len(members) > limits.max_members:
        raise APIError("prompt_batch_cap_exceeded",
                       f"a prompt array holds at most {limits.max_members} members, got {len(members)}", "prompt")
    lp = body.get("logprobs")
    if lp is None or lp is False:
        logprobs = None
    elif type(lp) is not int:
        raise bad_type("logprobs", f"an integer in [0, {limits.max_logprobs}]")
    elif not 0 <= lp <= limits.max_logprobs:
        raise bad_value("logprobs", f"an integer in [0, {limits.max_logprobs}]")
    else:
        logprobs = lp or None
    echo = body.get("echo", False)
    if type(echo) is not bool:
        raise bad_type("echo", "a boolean")
    fields = _sampling(body, vocab_size)
    max_tokens = integer(body, "max_tokens", 16, 0, P.MAX_TOKENS)
    if max_tokens == 0 and not echo:
        raise bad_value("max_tokens", "at least 1 (0 is only allowed with echo: true)")
    grammar, grammar_param = _grammar(body, limits.grammar)
    s = Sampling(max_tokens=max_tokens, logprobs=logprobs, echo=echo, grammar=grammar,
                 constrained_logprobs=_constrained(body, grammar), **fields, **_row_fields(body, vocab_size))
    stream, include_usage = _stream(body)
    if stream and len(members) > 1:
        raise APIError("unsupported_value", "a prompt array is an all-or-nothing batch and cannot stream", "stream")
    if len(members) > 1:
        ids_total = sum(len(m["ids"]) for m in members if "ids" in m)
        if ids_total > limits.batch_prompt_tokens:
            raise APIError("prompt_batch_token_budget_exceeded",
                           f"the batch holds {ids_total} prompt tokens; the budget is {limits.batch_prompt_tokens}", "prompt")
        total = len(members) * s.n * s.max_tokens
        if total > limits.batch_completion_tokens:
            raise APIError("batch_completion_budget_exceeded",
                           f"members x n x max_tokens = {total} exceeds the budget of {limits.batch_completion_tokens}",
                           "max_tokens")
    boolean(body, "return_tokens_as_token_ids", False)
    user = body.get("user")
    if user is not None and type(user) is not str:
        raise bad_type("user", "a string")
    return CompletionRequest(
        model=model, members=members, is_array=is_array, sampling=s, stream=stream, include_usage=include_usage,
        token_ids_labels=boolean(body, "return_tokens_as_token_ids", False), grammar_param=grammar_param)


def _prompt(body: dict, vocab_size: int) -> tuple[list[dict], bool]:
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("missing_required_parameter", "'prompt' is required", "prompt")
    p = body["prompt"]
    if type(p) is str:
        return [{"text": p}], False
    if type(p) is not list:
        raise bad_type("prompt", "a string, an array of strings, an array of token ids, or an array of token-id arrays")
    if not p:
        raise bad_value("prompt", "a non-empty array")
    first = p[0]
    if type(first) is int:  # one pre-tokenized prompt
        return [{"ids": token_ids(p, "prompt", vocab_size)}], False
    if type(first) is str:
        for i, x in enumerate(p):
            if type(x) is not str:
                raise bad_type(f"prompt[{i}]", "a string (a prompt array must not mix types)")
        return [{"text": x} for x in p], True
    if type(first) is list:
        out = []
        for i, x in enumerate(p):
            if type(x) is not list:
                raise bad_type(f"prompt[{i}]", "an array of token ids (a prompt array must not mix types)")
            if not x:
                raise bad_value(f"prompt[{i}]", "a non-empty array of token ids")
            out.append({"ids": token_ids(x, f"prompt[{i}]", vocab_size)})
        return out, True
    raise bad_type("prompt[0]", "a string, a token id or an array of token ids")


# ------------------------------------------------------------------ chat

CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
    "stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "logprobs", "top_logprobs",
    "stream", "stream_options", "user", "response_format", "structured_outputs", "tools", "tool_choice",
    "parallel_tool_calls", "prompt_logprobs", "constrained_logprobs", "distribution", "score_tokens", "cache_salt",
}
CHAT_REFUSED = {
    "echo": "echo is a /v1/completions feature; chat's is prompt_logprobs",
    "functions": "the deprecated functions API is not supported: use tools",
    "function_call": "the deprecated functions API is not supported: use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no reasoning controls",
    "web_search_options": "web search is not supported",
    "best_of": "not a chat completions parameter",
    "suffix": "not a chat completions parameter",
}
ROLES = P.ROLES


def _grammar(body: dict, gc: GrammarCheck) -> tuple[str | None, str | None]:
    """response_format or structured_outputs (one of them) as (grammar text, the field it came
    from), or (None, None)."""
    rf, so = response_format(body.get("response_format"), gc), structured_outputs(body.get("structured_outputs"), gc)
    if rf is not None and so is not None:
        raise APIError("invalid_value", "give response_format or structured_outputs, not both", "structured_outputs")
    return rf or so or (None, None)


def _constrained(body: dict, grammar: str | None) -> bool:
    """constrained_logprobs (probity's opt-in): report the grammar's renormalised distribution."""
    v = boolean(body, "constrained_logprobs", False)
    if v and grammar is None:
        raise APIError("invalid_value", "'constrained_logprobs' needs a grammar: response_format json_object or "
                       "json_schema, structured_outputs, or tool_choice required or a named function",
                       "constrained_logprobs")
    return v


def parse_chat(body: dict, served: str, vocab_size: int, limits: Limits, tool_format: str = "hermes") -> ChatRequest:
    check_keys(body, CHAT_FIELDS, CHAT_REFUSED)
    model = model_field(body, served)
    messages = parse_messages(body.get("messages"), tools=True)
    tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), tool_format,
                        limits.grammar)
    grammar, grammar_param = _grammar(body, limits.grammar)
    if tools is not None and tools.forced:
        if grammar is not None:
            raise APIError("invalid_value", f"tool_choice {tools.choice!r} decides the output's form: it cannot be "
                           "combined with response_format or structured_outputs", "tool_choice")
        grammar, grammar_param = tools.grammar(limits.grammar), "tool_choice"
    pl = body.get("prompt_logprobs")
    if pl is not None and (not is_int(pl) or not 0 <= pl <= limits.max_logprobs):
        raise (bad_type if not is_int(pl) else bad_value)("prompt_logprobs", f"an integer in [0, {limits.max_logprobs}]")
    logprobs = boolean(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not is_int(top):
        raise bad_type("top_logprobs", f"an integer in [0, {limits.max_logprobs}]")
    if top is not None and not 0 <= top <= limits.max_logprobs:
        raise bad_value("top_logprobs", f"an integer in [0, {limits.max_logprobs}]")
    if top and not logprobs:
        raise APIError("invalid_value", "'top_logprobs' requires logprobs: true", "top_logprobs")
    fields = _sampling(body, vocab_size)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise APIError("invalid_value", "give max_tokens or max_completion_tokens, not both", "max_tokens")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    top_k = top if logprobs else None
    if pl is not None:
        # the prompt's positions are reported with the same table width as its tokens
        top_k = max(top_k or 0, pl)
    rows = _row_fields(body, vocab_size)
    asked = "distribution" if rows["distribution"] else "score_tokens" if "score_tokens" in rows else None
    if asked and not logprobs:
        raise APIError("invalid_value", f"'{asked}' is reported in the logprobs of each token: it needs logprobs: true",
                       asked)
    if asked and pl is not None:
        raise APIError("unsupported_value", f"'{asked}' is reported for the completion's tokens, not with "
                       "prompt_logprobs: score a prompt's positions through /v1/completions with echo", asked)
    s = Sampling(max_tokens=integer(body, key, 16, 1, P.MAX_TOKENS), logprobs=top_k,
                 echo=pl is not None, grammar=grammar, constrained_logprobs=_constrained(body, grammar), **fields,
                 **rows)
    if pl is not None and s.n > 1:
        raise APIError("invalid_value", "prompt_logprobs is given once per request: use n = 1", "prompt_logprobs")
    stream, include_usage = _stream(body)
    if pl is not None and stream:
        raise APIError("unsupported_value", "prompt_logprobs is not streamed: ask without stream", "prompt_logprobs")
    user = body.get("user")
    if user is not None and type(user) is not str:
        raise bad_type("user", "a string")
    return ChatRequest(model=model, messages=messages, sampling=s, stream=stream, include_usage=include_usage,
                       tools=tools, prompt_logprobs=pl, top_logprobs=(top or 0) if logprobs else None,
                       grammar_param=grammar_param)


def _tool_calls(v: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls -> the SUBMIT's [{id, name, arguments}]."""
    if type(v) is not list or not v:
        raise bad_type(where, "a non-empty array of tool calls")
    if len(v) > P.MAX_TOOL_CALLS:
        raise bad_value(where, f"at most {P.MAX_TOOL_CALLS} calls")
    out = []
    for j, c in enumerate(v):
        w = f"{where}[{j}]"
        if type(c) is not dict:
            raise bad_type(w, "an object")
        check_keys(c, ("id", "type", "function"), where=w)
        if c.get("type", "function") != "function":
            raise APIError("unsupported_value", f"'{w}.type' must be \"function\"", f"{w}.type")
        f = c.get("function")
        if type(f) is not dict:
            raise bad_type(f"{w}.function", "an object")
        check_keys(f, ("name", "arguments"), where=f"{w}.function")
        if type(c.get("id")) is not str or not c["id"]:
            raise bad_type(f"{w}.id", "a non-empty string")
        for k in ("name", "arguments"):
            if type(f.get(k)) is not str:
                raise bad_type(f"{w}.function.{k}", "a string")
        if len(c["id"]) > 256 or len(f["name"]) > 256:
            raise bad_value(w, "an id and a name of at most 256 characters")
        out.append({"id": c["id"], "name": f["name"], "arguments": f["arguments"]})
    return out


def parse_messages(v: Any, roles: tuple[str, ...] = ROLES, param: str = "messages",
                   part_keys: tuple[str, ...] = (), tools: bool = False) -> list[dict]:
    """`tools`: OpenAI's tool messages are accepted too (assistant tool_calls, role tool)."""
    if v is None:
        raise APIError("missing_required_parameter", f"'{param}' is required", param)
    if type(v) is not list:
        raise bad_type(param, "an array of messages")
    if not v:
        raise bad_value(param, "a non-empty array")
    out = []
    roles = (*roles, "tool") if tools else roles
    call_ids: set[str] = set()
    for i, m in enumerate(v):
        where = f"{param}[{i}]"
        if type(m) is not dict:
            raise bad_type(where, "an object")
        role = m.get("role")
        extra = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}.get(role, ()) if tools and type(role) is str \
            else ()
        for k in m:
            if k not in ("role", "content", *extra):
                raise APIError("unsupported_parameter", f"'{where}.{k}' is not supported", f"{where}.{k}")
        calls = m.get("tool_calls") if tools and m.get("role") == "assistant" else None
        for k in ("role",) if calls is not None else ("role", "content"):
            if m.get(k) is None:
                raise APIError("missing_required_parameter", f"'{where}.{k}' is required", f"{where}.{k}")
        role = m["role"]
        if role not in roles:
            code = "invalid_type" if type(role) is not str else "unsupported_value"
            raise APIError(code, f"'{where}.role' must be one of {', '.join(roles)}", f"{where}.role")
        msg = {"role": "system" if role == "developer" else role,
               "content": "" if m.get("content") is None else text_content(m["content"], f"{where}.content", part_keys)}
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
            call_ids.update(c["id"] for c in msg["tool_calls"])
        if role == "tool":
            tid = m.get("tool_call_id")
            if type(tid) is not str:
                raise (missing_field if tid is None else lambda p: bad_type(p, "a string"))(f"{where}.tool_call_id")
            if tid not in call_ids:
                raise APIError("invalid_value", f"'{where}.tool_call_id' {tid[:64]!r} answers no tool call of an "
                               "earlier assistant message", f"{where}.tool_call_id")
            msg["tool_call_id"] = tid
        out.append(msg)
    return out


def text_content(c: Any, where: str, part_keys: tuple[str, ...] = ()) -> str:
    """A string, or an array of text parts {type: "text", text}; parts are joined.
    `part_keys` are further keys accepted in a part as documented no-ops."""
    if type(c) is str:
        return c
    if type(c) is not list:
        raise bad_type(where, "a string or an array of text parts")
    texts = []
    for j, part in enumerate(c):
        pw = f"{where}[{j}]"
        if type(part) is not dict:
            raise bad_type(pw, "an object")
        t = part.get("type")
        if t is None:
            raise missing_field(f"{pw}.type")
        if type(t) is not str:
            raise bad_type(f"{pw}.type", "a string")
        if t != "text":
            raise APIError("unsupported_value", f"'{pw}.type' {t!r} is not supported; only text parts are",
                           f"{pw}.type")
        for k in part:
            if k not in ("type", "text", *part_keys):
                raise APIError("unsupported_parameter", f"'{pw}.{k}' is not supported", f"{pw}.{k}")
        if part.get("text") is None:
            raise missing_field(f"{pw}.text")
        if type(part["text"]) is not str:
            raise bad_type(f"{pw}.text", "a string")
        texts.append(part["text"])
    return "".join(texts)
