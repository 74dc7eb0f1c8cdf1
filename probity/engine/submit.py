"""Check a SUBMIT payload field by field. The server validates first; the engine does not
trust it, and names the field of anything it refuses (ERROR BAD_REQUEST / CONTEXT_EXCEEDED)."""
from __future__ import annotations

import math
from typing import Any

from ..protocol import MAX_CHOICES, MAX_LOGPROBS, MAX_MEMBERS, MAX_RESULT_IDS, MAX_STOP_CHARS, MAX_STOPS
from .sequence import Sampling
from .vocab import Vocab


class Refusal(Exception):
    def __init__(self, code: str, message: str, param: str | None = None, member: int | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.member = code, message, param, member


def _bad(param: str, message: str, member: int | None = None) -> Refusal:
    return Refusal("BAD_REQUEST", message, param, member)


def _num(p: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = p.get(key, default)
    if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
        raise _bad(key, f"{key} must be a number in [{lo}, {hi}]")
    return float(v)


def _int(p: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = p.get(key, default)
    if v is None and default is None:
        return None
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(key, f"{key} must be an integer in [{lo}, {hi}]")
    return v


def parse_sampling(p: dict, vocab_size: int) -> Sampling:
    s = Sampling()
    s.max_tokens = _int(p, "max_tokens", 16, 0, 1 << 24)
    s.temperature = _num(p, "temperature", 1.0, 0.0, 2.0)
    s.top_p = _num(p, "top_p", 1.0, 0.0, 1.0)
    if s.top_p <= 0.0:
        raise _bad("top_p", "top_p must be in (0, 1]")
    s.top_k = _int(p, "top_k", 0, 0, vocab_size)
    s.seed = _int(p, "seed", None, -(2**63), 2**63 - 1)
    s.n = _int(p, "n", 1, 1, MAX_CHOICES)
    s.presence_penalty = _num(p, "presence_penalty", 0.0, -2.0, 2.0)
    s.frequency_penalty = _num(p, "frequency_penalty", 0.0, -2.0, 2.0)
    stop = p.get("stop", [])
    if type(stop) is not list or len(stop) > MAX_STOPS or any(
            type(x) is not str or not 0 < len(x) <= MAX_STOP_CHARS for x in stop):
        raise _bad("stop", f"stop must be a list of at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
    s.stop = stop
    bias = p.get("logit_bias", {})
    if type(bias) is not dict or len(bias) > 1024:
        raise _bad("logit_bias", "logit_bias must be an object of at most 1024 entries")
    for k, v in bias.items():
        if not (k.isdigit() and int(k) < vocab_size):
            raise _bad("logit_bias", f"logit_bias key {k!r} is not a token id in the vocabulary")
        if type(v) not in (int, float) or not -100 <= v <= 100:
            raise _bad("logit_bias", "logit_bias values must be numbers in [-100, 100]")
        s.logit_bias[int(k)] = float(v)
    s.logprobs = _int(p, "logprobs", None, 0, MAX_LOGPROBS)
    echo = p.get("echo", False)
    if type(echo) is not bool:
        raise _bad("echo", "echo must be a boolean")
    s.echo = echo
    if s.max_tokens == 0 and not s.echo:
        raise _bad("max_tokens", "max_tokens 0 is only meaningful with echo")
    return s


def parse_members(p: dict, vocab: Vocab, add_special_tokens: bool = True) -> list[list[int]]:
    members = p.get("members")
    if type(members) is not list or not 1 <= len(members) <= MAX_MEMBERS:
        raise _bad("members", f"members must be a list of 1..{MAX_MEMBERS}")
    prompts = []
    for i, m in enumerate(members):
        prompts.append(member_ids(m, i, vocab, add_special_tokens))
    return prompts


def member_ids(m: Any, i: int, vocab: Vocab, add_special_tokens: bool) -> list[int]:
    where = f"members[{i}]"
    if type(m) is not dict or len(m) != 1:
        raise _bad(where, "a member is one of {text}, {ids}, {messages}", i)
    if "text" in m:
        if type(m["text"]) is not str:
            raise _bad(where, "text must be a string", i)
        return vocab.encode(m["text"], add_special_tokens)
    if "ids" in m:
        ids = m["ids"]
        if type(ids) is not list or any(type(t) is not int or not 0 <= t < vocab.size for t in ids):
            raise _bad(where, f"ids must be integers in [0, {vocab.size})", i)
        return list(ids)
    if "messages" in m:
        if not vocab.has_chat_template:
            raise _bad(where, "the model has no chat template", i)
        msgs = m["messages"]
        if type(msgs) is not list or not msgs or any(
                type(x) is not dict or set(x) != {"role", "content"} or type(x["content"]) is not str
                or x["role"] not in ("system", "developer", "user", "assistant") for x in msgs):
            raise _bad(where, "messages must be a non-empty list of {role, content} text messages", i)
        try:
            return vocab.encode_chat(msgs)
        except Exception as e:  # a template that raises (e.g. role order) is the request's fault
            raise _bad(where, f"the chat template refused these messages: {e}", i) from None
    raise _bad(where, "a member is one of {text}, {ids}, {messages}", i)


def parse_generate(p: dict, vocab: Vocab, context_length: int) -> tuple[Sampling, list[list[int]]]:
    """Everything a generate SUBMIT must pass before ACCEPT: fields, members, context, budget."""
    sampling = parse_sampling(p, vocab.size)
    prompts = parse_members(p, vocab, add_special_tokens=True)
    for i, ids in enumerate(prompts):
        if not ids:
            raise Refusal("BAD_REQUEST", "the prompt is empty after tokenization", f"members[{i}]", i)
        if len(ids) + sampling.max_tokens > context_length:
            raise Refusal("CONTEXT_EXCEEDED",
                          f"prompt of {len(ids)} tokens + max_tokens {sampling.max_tokens} exceeds the "
                          f"context window of {context_length} tokens", f"members[{i}]", i)
    budget = p.get("max_prompt_tokens")
    if budget is not None:
        if type(budget) is not int or budget < 1:
            raise Refusal("BAD_REQUEST", "max_prompt_tokens must be a positive integer", "max_prompt_tokens")
        total = sum(len(ids) for ids in prompts)
        if total > budget:
            raise Refusal("PROMPT_BUDGET", f"the members hold {total} prompt tokens; the budget is {budget}",
                          "members")
    return sampling, prompts


def run_op(op: str, p: dict, vocab: Vocab) -> dict:
    """The non-generate ops (tokenize, render, detokenize): the tokenizer alone answers them."""
    add_special = p.get("add_special_tokens", True)
    if type(add_special) is not bool:
        raise Refusal("BAD_REQUEST", "add_special_tokens must be a boolean", "add_special_tokens")
    if op == "tokenize":
        members = p.get("members")
        if type(members) is not list or len(members) != 1:
            raise Refusal("BAD_REQUEST", "tokenize takes exactly one member", "members")
        count_only = p.get("count_only", False)
        if type(count_only) is not bool:
            raise Refusal("BAD_REQUEST", "count_only must be a boolean", "count_only")
        ids = member_ids(members[0], 0, vocab, add_special)
        if count_only:
            return {"count": len(ids)}
        if len(ids) > MAX_RESULT_IDS:
            raise Refusal("TOO_LARGE", f"the text is {len(ids)} tokens; one tokenize answer holds at most "
                          f"{MAX_RESULT_IDS}", "members[0]", 0)
        return {"ids": ids, "count": len(ids)}
    if op == "render":
        members = p.get("members")
        if type(members) is not list or len(members) != 1 or type(members[0]) is not dict or "messages" not in members[0]:
            raise Refusal("BAD_REQUEST", "render takes exactly one {messages} member", "members")
        ids = member_ids(members[0], 0, vocab, False)
        return {"text": vocab.render(members[0]["messages"]), "ids": ids, "count": len(ids)}
    if op == "detokenize":
        ids = p.get("ids")
        if type(ids) is not list or any(type(t) is not int or not 0 <= t < vocab.size for t in ids):
            raise Refusal("BAD_REQUEST", f"ids must be integers in [0, {vocab.size})", "ids")
        return {"text": vocab.decode(ids), "count": len(ids)}
    raise Refusal("BAD_REQUEST", f"unknown op {op!r}", "op")
