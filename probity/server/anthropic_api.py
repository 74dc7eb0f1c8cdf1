"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages API)."""
from __future__ import annotations

import asyncio
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
from .generation import Generation, Source, run_op
from .validation import _bool, _check_keys, _integer, _model, _number, _stop, _type, parse_messages, text_content

if TYPE_CHECKING:
    from .service import Service


PING_EVERY = 10.0  # seconds without an event before a ping keeps the stream alive
MESSAGE_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                  "stream", "metadata"}
MESSAGE_REFUSED = {
    "tools": "tool use is not supported",
    "tool_choice": "tool use is not supported",
    "thinking": "extended thinking is not supported",
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
    "service_tier": "service tiers are not supported",
}
COUNT_TOKENS_FIELDS = {"model", "messages", "system"}


@dataclass
class MessagesRequest:
    model: str
    messages: list[dict]
    sampling: Sampling
    stream: bool


def _messages_and_system(body: dict) -> list[dict]:
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


def parse_messages_request(body: dict, served: str, vocab_size: int) -> MessagesRequest:
    _check_keys(body, MESSAGE_FIELDS, MESSAGE_REFUSED)
    model = _model(body, served)
    if body.get("max_tokens") is None:
        raise APIError("missing_required_parameter", "'max_tokens' is required", "max_tokens")
    max_tokens = _integer(body, "max_tokens", None, 1, P.MAX_TOKENS)
    messages = _messages_and_system(body)
    if body.get("stop_sequences") is not None and type(body["stop_sequences"]) is not list:
        raise _type("stop_sequences", "an array of strings")
    s = Sampling(max_tokens=max_tokens, stop=tuple(_stop(body, "stop_sequences")),
                 # Anthropic's own range: [0, 1]
                 temperature=_number(body, "temperature", 1.0, 0.0, 1.0),
                 top_p=_number(body, "top_p", 1.0, *P.TOP_P, lo_open=True),
                 top_k=_integer(body, "top_k", 0, 0, vocab_size))
    stream = _bool(body, "stream", False)
    meta = body.get("metadata")
    if meta is not None:
        if type(meta) is not dict:
            raise _type("metadata", "an object")
        for k, v in meta.items():
            if k != "user_id":
                raise APIError("unknown_parameter", f"unknown parameter 'metadata.{k}'", f"metadata.{k}")
            if v is not None and type(v) is not str:
                raise _type("metadata.user_id", "a string")
    return MessagesRequest(model, messages, s, stream)


def _usage(done: dict) -> dict:
    u = done["usage"]
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": u["cached_tokens"], "cache_creation_input_tokens": 0}


def _stop_reason(c: dict) -> tuple[str, str | None]:
    if c["finish_reason"] == "length":
        return "max_tokens", None
    if c["stop"] is not None:
        return "stop_sequence", c["stop"]
    return "end_turn", None


async def messages(svc: Service, request: Request, body: dict):
    info = svc.ready_info()
    m = info["model"]
    req = parse_messages_request(body, m["id"], m["vocab_size"])
    check_capabilities(info, chat=True)
    gen = Generation(svc, request, P.generate_payload([{"messages": req.messages}], req.sampling), Source("messages"))
    await gen.start()
    msg_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return gen.streaming(stream_message(gen, msg_id, m["id"]), msg_id,
                             lambda e: event("error", {"type": "error", "error": e.anthropic_body()["error"]}))
    out = await gen.collect()
    pieces = build_pieces(out.tokens.get((0, 0), []))
    reason, seq = _stop_reason(out.done["choices"][0])
    return JSONResponse({
        "id": msg_id, "type": "message", "role": "assistant", "model": m["id"],
        "content": [{"type": "text", "text": "".join(p.text for p in pieces)}],
        "stop_reason": reason, "stop_sequence": seq, "usage": _usage(out.done)}, headers=gen.headers)


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def stream_message(gen: Generation, msg_id: str, model: str):
    prompt_tokens = gen.accept["members"][0]["prompt_tokens"]
    cached = gen.accept["members"][0]["cached_tokens"]
    text = TextBuilder()
    nxt = None
    try:
        yield event("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": cached,
                      "cache_creation_input_tokens": 0}}})
        yield event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
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
                if piece:
                    yield event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                        "delta": {"type": "text_delta", "text": piece}})
            elif f.kind == "DONE":
                gen.account(f.payload)
                tail = text.finish()
                if tail:
                    yield event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                        "delta": {"type": "text_delta", "text": tail}})
                reason, seq = _stop_reason(f.payload["choices"][0])
                yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
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
    _check_keys(body, COUNT_TOKENS_FIELDS, {k: MESSAGE_REFUSED[k] for k in ("tools", "tool_choice", "thinking")})
    _model(body, info["model"]["id"])
    check_capabilities(info, chat=True)
    # only the count comes back: no ids cross the pipe, so no text is too long to count
    result = await run_op(svc, request, {"op": "tokenize", "members": [{"messages": _messages_and_system(body)}],
                                         "add_special_tokens": False, "count_only": True}, Source("messages"))
    return {"input_tokens": result["count"]}
