"""A SUBMIT turned into work, or refused by name: what the frame's schema cannot know is
checked here against the model (token ids against the vocabulary, the chat template, the
context window, the batch's prompt budget), and the tokenizer ops are answered. The schema
itself, and the `Sampling` it yields, are the wire contract's (protocol/submit.py); both
engine backends use this module, so they refuse alike."""
from __future__ import annotations

from typing import Any

from .. import protocol as P
from ..protocol import Sampling, strict_json
from .vocab import Vocab


class Refusal(Exception):
    """An ERROR frame for a request the engine will not run: code, message, param, member."""

    def __init__(self, code: str, message: str, param: str | None = None, member: int | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.member = code, message, param, member

    @classmethod
    def bad_field(cls, e: P.SchemaError) -> "Refusal":
        param, member = P.param_of(e.path)
        return cls("BAD_REQUEST", str(e), param, member)

    def payload(self) -> dict:
        out: dict[str, Any] = {"code": self.code, "message": self.message[:8000]}
        if self.param:
            out["param"] = self.param
        if self.member is not None:
            out["member"] = self.member
        return out


def _bad(param: str, message: str, member: int | None = None) -> Refusal:
    return Refusal("BAD_REQUEST", message, param, member)


def parse_generate(p: dict, vocab: Vocab, context_length: int
                   ) -> tuple[Sampling, list[list[int]], dict[int, list[bool]]]:
    """Everything a generate SUBMIT must pass before ACCEPT: fields, members, context, budget.
    With echo, a messages member's flags too: which of its prompt tokens are the template's."""
    try:
        s = Sampling.from_wire(p)
    except P.SchemaError as e:
        raise Refusal.bad_field(e) from None
    if s.top_k > vocab.size:
        raise _bad("top_k", f"top_k must be at most the vocabulary size {vocab.size}")
    if any(k >= vocab.size for k in s.logit_bias):
        raise _bad("logit_bias", f"logit_bias keys must be token ids below {vocab.size}")
    if "members" not in p:
        raise _bad("members", "members is required")
    tools = _tools(p)
    marks = {i: [] for i, m in enumerate(p["members"]) if s.echo and "messages" in m}
    prompts = [member_ids(m, i, vocab, add_special_tokens=True, tools=tools, marks=marks.get(i))
               for i, m in enumerate(p["members"])]
    for i, ids in enumerate(prompts):
        if not ids:
            raise _bad(f"members[{i}]", "the prompt is empty after tokenization", i)
        if len(ids) + s.max_tokens > context_length:
            raise Refusal("CONTEXT_EXCEEDED",
                          f"prompt of {len(ids)} tokens + max_tokens {s.max_tokens} exceeds the "
                          f"context window of {context_length} tokens", f"members[{i}]", i)
    budget = p.get("max_prompt_tokens")
    if budget is not None:
        total = sum(len(ids) for ids in prompts)
        if total > budget:
            raise Refusal("PROMPT_BUDGET", f"the members hold {total} prompt tokens; the budget is {budget}",
                          "members")
    return s, prompts, marks


def _tools(p: dict) -> list[dict] | None:
    """SUBMIT's tools (JSON text of OpenAI's tools array, checked by the server)."""
    if "tools" not in p:
        return None
    try:
        tools = strict_json.loads(p["tools"])
    except Exception as e:
        raise _bad("tools", f"tools is not JSON: {e}") from None
    if type(tools) is not list:
        raise _bad("tools", "tools must be a JSON array")
    return tools


def member_ids(m: dict, i: int, vocab: Vocab, add_special_tokens: bool, tools: list[dict] | None = None,
               marks: list[bool] | None = None) -> list[int]:
    """A member's token ids (its shape already checked by the schema: one of text, ids, messages)."""
    where = f"members[{i}]"
    if "text" in m:
        return vocab.encode(m["text"], add_special_tokens)
    if "ids" in m:
        if any(t >= vocab.size for t in m["ids"]):
            raise _bad(where, f"ids must be integers in [0, {vocab.size})", i)
        return list(m["ids"])
    if not vocab.has_chat_template:
        raise _bad(where, "the model has no chat template", i)
    try:
        return vocab.encode_chat(m["messages"], tools, marks)
    except Exception as e:  # a template that raises (e.g. role order) is the request's fault
        raise _bad(where, f"the chat template refused these messages: {e}", i) from None


def run_op(op: str, p: dict, vocab: Vocab) -> dict:
    """The non-generate ops (tokenize, render, detokenize): the tokenizer alone answers them."""
    add_special = p.get("add_special_tokens", True)
    members = p.get("members")
    tools = _tools(p)
    if op == "tokenize":
        if members is None or len(members) != 1:
            raise _bad("members", "tokenize takes exactly one member")
        ids = member_ids(members[0], 0, vocab, add_special, tools)
        if p.get("count_only", False):
            return {"count": len(ids)}
        if len(ids) > P.MAX_RESULT_IDS:
            raise Refusal("TOO_LARGE", f"the text is {len(ids)} tokens; one tokenize answer holds at most "
                          f"{P.MAX_RESULT_IDS}", "members[0]", 0)
        return {"ids": ids, "count": len(ids)}
    if op == "render":
        if members is None or len(members) != 1 or "messages" not in members[0]:
            raise _bad("members", "render takes exactly one {messages} member")
        ids = member_ids(members[0], 0, vocab, False, tools)
        return {"text": vocab.render(members[0]["messages"], tools), "ids": ids, "count": len(ids)}
    ids = p.get("ids")  # detokenize
    if ids is None or any(t >= vocab.size for t in ids):
        raise _bad("ids", f"ids must be integers in [0, {vocab.size})")
    return {"text": vocab.decode(ids), "count": len(ids)}
