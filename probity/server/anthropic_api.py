"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages API)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from dataclasses import dataclass

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse

from .. import protocol as P
from ..protocol import Sampling
from .pieces import TextBuilder, build_pieces
from .capabilities import check_capabilities
from .errors import APIError
from .fields import bad_type, boolean, check_keys, integer, model_field, number, stop_field
from .generation import Generation, Source, run_op
from .grammar_check import GrammarCheck
from .structured import DEFAULT_CHECK
from .tools import Tools, ToolText, calls_of, in_use, parse_tools
from .validation import off_loop, parse_messages, text_content

if TYPE_CHECKING:
    from .service import Service


PING_EVERY = 10.0  # seconds without an event before a ping keeps the stream alive
MESSAGE_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                  "stream", "metadata", "tools", "tool_choice"}
MESSAGE_REFUSED = {
    "thinking": "extended thinking is not supported",
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
    "service_tier": "service tiers are not supported",
}
COUNT_TOKENS_FIELDS = {"model", "messages", "system", "tools", "tool_choice"}


@dataclass
class MessagesRequest:
    model: str
    messages: list[dict]
    sampling: Sampling
    stream: bool
    tools: Tools | None = None


def _anthropic_tools(body: dict, fmt: str, gc: GrammarCheck = DEFAULT_CHECK) -> Tools | None:
    """Anthropic's tools and tool_choice in OpenAI's shape (structured.Tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and type(choice) is not dict:
        raise bad_type("tool_choice", "an object")
    if tools is None:
        if choice is not None and choice.get("type") not in ("auto", "none"):
            raise APIError("invalid_value", "'tool_choice' needs 'tools'", "tool_choice")
        return None
    if type(tools) is not list:
        raise bad_type("tools", "an array")
    openai = []
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        if type(t) is not dict:
            raise bad_type(w, "an object")
        check_keys(t, ("name", "description", "input_schema", "type", "cache_control"), where=w)
        if t.get("type", "custom") != "custom":
            raise APIError("unsupported_value", f"'{w}.type' {t['type']!r}: only custom (client) tools are supported",
                           f"{w}.type")
        if t.get("input_schema") is None:
            raise APIError("missing_required_parameter", f"'{w}.input_schema' is required", f"{w}.input_schema")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        openai.append({"type": "function", "function": fn})
    parallel, oc = None, None
    if choice is not None:   # (an object: checked first)
        check_keys(choice, ("type", "name", "disable_parallel_tool_use"), where="tool_choice")
        kind = choice.get("type")
        mapping = {"auto": "auto", "any": "required", "none": "none"}
        if kind == "tool":
            if type(choice.get("name")) is not str:
                raise APIError("missing_required_parameter", "'tool_choice.name' is required", "tool_choice.name")
            oc = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in mapping:
            oc = mapping[kind]
        else:
            raise APIError("invalid_value", "'tool_choice.type' must be auto, any, tool or none", "tool_choice.type")
        d = choice.get("disable_parallel_tool_use")
        if d is not None:
            if type(d) is not bool:
                raise bad_type("tool_choice.disable_parallel_tool_use", "a boolean")
            parallel = not d
    try:
        return parse_tools(openai, oc, parallel, fmt, gc)
    except APIError as e:  # OpenAI's names of the same fields -> Anthropic's
        if e.param:
            e.param = (e.param.replace(".function.parameters", ".input_schema").replace(".function.", ".")
                       .replace("tool_choice.function.name", "tool_choice.name"))
        raise


def _content_blocks(c, where: str, role: str) -> tuple[str, list[dict], list[dict]]:
    """A message's content -> (text, tool_calls, tool results) in the SUBMIT's shapes."""
    if type(c) is str:
        return c, [], []
    if type(c) is not list:
        raise bad_type(where, "a string or an array of content blocks")
    texts, calls, results = [], [], []
    for j, b in enumerate(c):
        w = f"{where}[{j}]"
        if type(b) is not dict:
            raise bad_type(w, "an object")
        t = b.get("type")
        if t == "text":
            texts.append(text_content([b], where, ("cache_control", "citations")))
        elif t == "tool_use" and role == "assistant":
            check_keys(b, ("type", "id", "name", "input", "cache_control"), where=w)
            for k in ("id", "name"):
                if type(b.get(k)) is not str or not b[k]:
                    raise bad_type(f"{w}.{k}", "a non-empty string")
            if type(b.get("input")) is not dict:
                raise bad_type(f"{w}.input", "an object")
            calls.append({"id": b["id"][:256], "name": b["name"][:256],
                          "arguments": json.dumps(b["input"], ensure_ascii=False)})
        elif t == "tool_result" and role == "user":
            check_keys(b, ("type", "tool_use_id", "content", "is_error", "cache_control"), where=w)
            if type(b.get("tool_use_id")) is not str:
                raise bad_type(f"{w}.tool_use_id", "a string")
            if b.get("is_error") is not None and type(b["is_error"]) is not bool:
                raise bad_type(f"{w}.is_error", "a boolean")
            body = "" if b.get("content") is None else text_content(b["content"], f"{w}.content", ("cache_control",))
            results.append({"role": "tool", "content": ("Error: " + body) if b.get("is_error") else body,
                            "tool_call_id": b["tool_use_id"]})
        else:
            raise APIError("unsupported_value", f"'{w}.type' {t!r} is not supported in a {role} message here",
                           f"{w}.type")
    return "".join(texts), calls, results


def _parse_anthropic_messages(v) -> list[dict]:
    """Anthropic's messages (text, tool_use and tool_result blocks) -> the SUBMIT's messages."""
    if v is None:
        raise APIError("missing_required_parameter", "'messages' is required", "messages")
    if type(v) is not list or not v:
        raise bad_type("messages", "a non-empty array of messages")
    out, ids = [], set()
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if type(m) is not dict:
            raise bad_type(where, "an object")
        for k in m:
            if k not in ("role", "content"):
                raise APIError("unsupported_parameter", f"'{where}.{k}' is not supported", f"{where}.{k}")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise APIError("invalid_type" if type(role) is not str else "unsupported_value",
                           f"'{where}.role' must be one of user, assistant", f"{where}.role")
        if m.get("content") is None:
            raise APIError("missing_required_parameter", f"'{where}.content' is required", f"{where}.content")
        text, calls, results = _content_blocks(m["content"], f"{where}.content", role)
        for r in results:
            if r["tool_call_id"] not in ids:
                raise APIError("invalid_value", f"tool_result names tool_use_id {r['tool_call_id'][:64]!r}, which no "
                               "earlier tool_use block has", f"{where}.content")
        out += results
        if calls:
            ids.update(c["id"] for c in calls)
            out.append({"role": role, "content": text, "tool_calls": calls})
        elif text or not results:
            out.append({"role": role, "content": text})
    return out


def _messages_and_system(body: dict) -> list[dict]:
    given = body.get("messages")
    if type(given) is list and any(type(m) is dict and type(m.get("content")) is list and any(
            type(b) is dict and b.get("type") in ("tool_use", "tool_result") for b in m["content"]) for m in given):
        messages = _parse_anthropic_messages(body.get("messages"))
    else:
        messages = parse_messages(body.get("messages"), roles=("user", "assistant"), part_keys=("cache_control",))
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] != last["content"].rstrip():
        # A final assistant message is a prefill the model continues; Anthropic refuses one
        # ending in whitespace (templates may trim it, so the continuation would not follow it).
        raise APIError("invalid_value", "final assistant content cannot end with trailing whitespace",
                       f"messages[{len(messages) - 1}].content")
    system = body.get("system")
    if system is not None:
        messages.insert(0, {"role": "system", "content": text_content(system, "system", ("cache_control",))})
    return messages


def parse_messages_request(body: dict, served: str, vocab_size: int, fmt: str = "hermes",
                           gc: GrammarCheck = DEFAULT_CHECK) -> MessagesRequest:
    check_keys(body, MESSAGE_FIELDS, MESSAGE_REFUSED)
    model = model_field(body, served)
    if body.get("max_tokens") is None:
        raise APIError("missing_required_parameter", "'max_tokens' is required", "max_tokens")
    max_tokens = integer(body, "max_tokens", None, 1, P.MAX_TOKENS)
    messages = _messages_and_system(body)
    if body.get("stop_sequences") is not None and type(body["stop_sequences"]) is not list:
        raise bad_type("stop_sequences", "an array of strings")
    s = Sampling(max_tokens=max_tokens, stop=tuple(stop_field(body, "stop_sequences")),
                 # Anthropic's own range: [0, 1]
                 temperature=number(body, "temperature", 1.0, 0.0, 1.0),
                 top_p=number(body, "top_p", 1.0, *P.TOP_P, lo_open=True),
                 top_k=integer(body, "top_k", 0, 0, vocab_size))
    tools = _anthropic_tools(body, fmt, gc)
    if tools is not None and tools.forced:
        s = dataclasses.replace(s, grammar=tools.grammar(gc))
    stream = boolean(body, "stream", False)
    meta = body.get("metadata")
    if meta is not None:
        if type(meta) is not dict:
            raise bad_type("metadata", "an object")
        for k, v in meta.items():
            if k != "user_id":
                raise APIError("unknown_parameter", f"unknown parameter 'metadata.{k}'", f"metadata.{k}")
            if v is not None and type(v) is not str:
                raise bad_type("metadata.user_id", "a string")
    return MessagesRequest(model, messages, s, stream, tools)


def _usage(done: dict) -> dict:
    u = done["usage"]
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": u["cached_tokens"], "cache_creation_input_tokens": 0}


def _stop_reason(c: dict) -> tuple[str, str | None]:
    if c["finish_reason"] == "grammar_dead_end":
        return "grammar_dead_end", None
    if c["finish_reason"] == "length":
        return "max_tokens", None
    if c["stop"] is not None:
        return "stop_sequence", c["stop"]
    return "end_turn", None


def _tool_use(text: str, tools: Tools | None, finish: str) -> tuple[str, list[dict]] | None:
    """calls_of's content and calls, the calls as Anthropic's tool_use blocks."""
    found = calls_of(text, tools, finish)
    if found is None:
        return None
    content, calls = found
    return content, [{"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name,
                      "input": json.loads(c.arguments)} for c in calls]


async def messages(svc: Service, request: Request, body: dict):
    info = svc.ready_info()
    m = info["model"]
    req = await off_loop(parse_messages_request, body, m["id"], m["vocab_size"],
                         info["capabilities"].get("tool_format", "hermes"), svc.limits.grammar)
    check_capabilities(info, chat=True, grammar=req.sampling.grammar is not None)
    payload = P.generate_payload([{"messages": req.messages}], req.sampling,
                                 tools=req.tools.wire() if in_use(req.tools) else None)
    gen = Generation(svc, request, payload, Source("messages", grammar="tool_choice"))
    await gen.start()
    msg_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return gen.streaming(stream_message(gen, msg_id, m["id"], req.tools), msg_id,
                             lambda e: event("error", {"type": "error", "error": e.anthropic_body()["error"]}))
    out = await gen.collect()
    pieces = build_pieces(out.tokens.get((0, 0), []))
    text = "".join(p.text for p in pieces)
    reason, seq = _stop_reason(out.done["choices"][0])
    content = [{"type": "text", "text": text}]
    used = _tool_use(text, req.tools, out.done["choices"][0]["finish_reason"])
    if used is not None:
        content = ([{"type": "text", "text": used[0]}] if used[0] else []) + used[1]
        reason, seq = "tool_use", None
    return JSONResponse({
        "id": msg_id, "type": "message", "role": "assistant", "model": m["id"],
        "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": _usage(out.done)},
        headers=gen.headers)


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def stream_message(gen: Generation, msg_id: str, model: str, tools: Tools | None = None):
    prompt_tokens = gen.accept["members"][0]["prompt_tokens"]
    cached = gen.accept["members"][0]["cached_tokens"]
    text = TextBuilder()
    held = ToolText(tools) if in_use(tools) else None

    opened = False   # with tools, the text block opens at the first text: an answer that is only calls has none

    def open_text() -> bytes:
        nonlocal opened
        opened = True
        return event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})

    open_block: int | None = None   # a forced call's tool_use block that has started and not ended

    def forced_blocks():
        """A forced call's tool_use blocks as its parts are written (streaming's
        ForcedCalls events): start, input_json_delta per fragment, stop."""
        nonlocal open_block
        if held is None:
            return
        for ev in held.events:
            if ev[0] == "start":
                open_block = ev[1]
                yield event("content_block_start", {"type": "content_block_start", "index": ev[1], "content_block": {
                    "type": "tool_use", "id": "toolu_" + ev[2].removeprefix("call_"), "name": ev[3], "input": {}}})
            elif ev[0] == "args":
                yield event("content_block_delta", {"type": "content_block_delta", "index": ev[1],
                                                    "delta": {"type": "input_json_delta", "partial_json": ev[2]}})
            else:
                open_block = None
                yield event("content_block_stop", {"type": "content_block_stop", "index": ev[1]})
        held.events.clear()

    def delta(piece: str) -> bytes:
        head = b"" if opened else open_text()
        return head + event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta", "text": piece}})
    nxt = None
    try:
        yield event("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": cached,
                      "cache_creation_input_tokens": 0}}})
        if held is None:   # without tools there is always one text block: it opens at once
            yield open_text()
        yield event("ping", {"type": "ping"})
        frames = gen.frames().__aiter__()
        while True:
            nxt = asyncio.ensure_future(frames.__anext__())
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=PING_EVERY)
                if done:
                    break
                yield event("ping", {"type": "ping"})
            try:
                f = nxt.result()
            except StopAsyncIteration:
                break
            if f.kind == "TOKEN":
                piece = "".join(text.feed(e).text for e in f.payload["tokens"])
                if held is not None:
                    piece = held.add(piece)
                if piece:
                    yield delta(piece)
                for b in forced_blocks():
                    yield b
            elif f.kind == "DONE":
                gen.account(f.payload)
                tail = text.finish()
                if held is not None:
                    tail = held.add(tail)
                if tail:
                    yield delta(tail)
                reason, seq = _stop_reason(f.payload["choices"][0])
                if held is not None and held.forced is not None:
                    # the calls went out as they were written; one cut by max_tokens is closed as it stands
                    for b in forced_blocks():
                        yield b
                    if open_block is not None:
                        yield event("content_block_stop", {"type": "content_block_stop", "index": open_block})
                    if held.forced.index < 0:
                        yield open_text()
                        yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
                    elif reason == "end_turn":
                        reason, seq = "tool_use", None
                else:
                    used = None
                    if held is not None and held.held:
                        used = _tool_use(held.seen, tools, f.payload["choices"][0]["finish_reason"])
                    if held is not None and used is None and held.pending:
                        yield delta(held.pending)
                    if not opened and not used:
                        yield open_text()
                    if opened:
                        yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
                    for i, block in enumerate(used[1] if used else [], start=int(opened)):
                        yield event("content_block_start", {"type": "content_block_start", "index": i,
                                                            "content_block": {**block, "input": {}}})
                        yield event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                        yield event("content_block_stop", {"type": "content_block_stop", "index": i})
                    if used:
                        reason, seq = "tool_use", None
                yield event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason, "stop_sequence": seq},
                                              "usage": {"output_tokens": f.payload["usage"]["completion_tokens"]}})
                yield event("message_stop", {"type": "message_stop"})
                return
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()


async def count_tokens(svc: Service, request: Request, body: dict):
    info = svc.ready_info()
    check_keys(body, COUNT_TOKENS_FIELDS, {k: MESSAGE_REFUSED[k] for k in ("thinking",)})
    model_field(body, info["model"]["id"])
    check_capabilities(info, chat=True)
    tools = await off_loop(_anthropic_tools, body, info["capabilities"].get("tool_format", "hermes"), svc.limits.grammar)
    op = {"op": "tokenize", "members": [{"messages": _messages_and_system(body)}], "add_special_tokens": False,
          "count_only": True}
    if in_use(tools):
        op["tools"] = tools.wire()
    # only the count comes back: no ids cross the pipe, so no text is too long to count
    result = await run_op(svc, request, op, Source("messages"))
    return {"input_tokens": result["count"]}
