"""POST /v1/completions and /v1/chat/completions."""
from __future__ import annotations

import functools
import json
import time
import uuid

from typing import TYPE_CHECKING

from starlette.requests import Request

from .. import protocol as P
from .pieces import TextBuilder, build_pieces, chat_logprobs, completion_logprobs
from .capabilities import check_capabilities
from .generation import Generation, Source
from .responses import json_answer
from .validation import ChatRequest, CompletionRequest, parse_chat, parse_completion

if TYPE_CHECKING:
    from .service import Service


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(done: dict) -> dict:
    u = done["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


async def completions(svc: Service, request: Request, body: dict):
    info = svc.ready_info()
    m = info["model"]
    req = parse_completion(body, m["id"], m["vocab_size"], svc.limits)
    s = req.sampling
    check_capabilities(info, logprobs=s.logprobs, echo=s.echo, ids=any("ids" in x for x in req.members),
                       seed=s.seed is not None, members=len(req.members), choices=s.n)
    budget = svc.limits.batch_prompt_tokens if len(req.members) > 1 else None
    gen = Generation(svc, request, P.generate_payload(req.members, s, budget), Source("prompt", req.is_array),
                     members=len(req.members), choices=s.n, echo=s.echo)
    await gen.start()
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": m["id"],
            "system_fingerprint": m["fingerprint"]}
    if req.stream:
        return gen.streaming(stream_completion(gen, req, meta), meta["id"])
    out = await gen.collect()
    n = s.n
    fins = {(c["member"], c["choice"]): c for c in out.done["choices"]}

    def choice(mi: int, ci: int) -> dict:
        pieces = build_pieces(out.tokens.pop((mi, ci), []), out.echo.get(mi, []) if ci < n - 1 else out.echo.pop(mi, []))
        lp = None
        if s.logprobs is not None:
            lp = completion_logprobs(pieces, 0, req.token_ids_labels).as_dict()
        return {"index": mi * n + ci, "text": "".join(p.text for p in pieces), "logprobs": lp,
                "finish_reason": fins[(mi, ci)]["finish_reason"]}

    items = (functools.partial(choice, mi, ci) for mi in range(len(req.members)) for ci in range(n))
    return json_answer({**meta, "object": "text_completion"}, "choices", items, {"usage": usage(out.done)},
                       gen.headers, out.size)


class _ChoiceStream:
    """One streamed choice: holds pieces back while a UTF-8 character is incomplete."""

    def __init__(self):
        self.builder = TextBuilder()
        self.held: list = []
        self.offset = 0

    def add(self, entries: list[dict], conditioned_from: int = 0) -> list:
        for j, e in enumerate(entries):
            self.held.append(self.builder.feed(e, conditioned=(j >= conditioned_from)))
        if self.builder.pending:
            return []
        out, self.held = self.held, []
        return out

    def flush(self) -> list:
        self.builder.finish()
        out, self.held = self.held, []
        return out


async def stream_completion(gen: Generation, req: CompletionRequest, meta: dict):
    n = req.sampling.n
    k = req.sampling.logprobs
    streams = [_ChoiceStream() for _ in range(n)]
    echo: list[dict] = []
    echo_sent = not req.sampling.echo
    no_usage = {"usage": None} if req.include_usage else {}  # as OpenAI: every chunk but the last says null

    def chunk(ci: int, pieces: list, finish: str | None = None) -> bytes:
        s = streams[ci]
        text = "".join(p.text for p in pieces)
        lp = None
        if k is not None:
            lp = completion_logprobs(pieces, s.offset, req.token_ids_labels).as_dict()
        s.offset += len(text)
        return sse({**meta, "object": "text_completion",
                    "choices": [{"index": ci, "text": text, "logprobs": lp, "finish_reason": finish}], **no_usage})

    async for f in gen.frames():
        p = f.payload
        if f.kind == "ECHO":
            echo.extend(p["positions"])
            continue
        if not echo_sent:
            echo_sent = True
            for ci in range(n):
                pieces = streams[ci].add(echo, conditioned_from=1)
                if pieces:
                    yield chunk(ci, pieces)
        if f.kind == "TOKEN":
            pieces = streams[p["choice"]].add(p["tokens"])
            if pieces:
                yield chunk(p["choice"], pieces)
        else:
            gen.account(p)
            for c in sorted(p["choices"], key=lambda c: c["choice"]):
                yield chunk(c["choice"], streams[c["choice"]].flush(), c["finish_reason"])
            if req.include_usage:
                yield sse({**meta, "object": "text_completion", "choices": [], "usage": usage(p)})
            yield b"data: [DONE]\n\n"


async def chat_completions(svc: Service, request: Request, body: dict):
    info = svc.ready_info()
    m = info["model"]
    req = parse_chat(body, m["id"], m["vocab_size"], svc.limits)
    s = req.sampling
    k = s.logprobs
    check_capabilities(info, logprobs=k, seed=s.seed is not None, chat=True, choices=s.n)
    gen = Generation(svc, request, P.generate_payload([{"messages": req.messages}], s), Source("messages"),
                     choices=s.n)
    await gen.start()
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": m["id"],
            "system_fingerprint": m["fingerprint"]}
    if req.stream:
        return gen.streaming(stream_chat(gen, req, meta), meta["id"])
    out = await gen.collect()
    fins = {c["choice"]: c for c in out.done["choices"]}

    def choice(ci: int) -> dict:
        pieces = build_pieces(out.tokens.pop((0, ci), []))
        lp = {"content": _chat_lp(pieces, k), "refusal": None} if k is not None else None
        return {"index": ci, "message": {"role": "assistant", "content": "".join(p.text for p in pieces),
                                         "refusal": None},
                "logprobs": lp, "finish_reason": fins[ci]["finish_reason"]}

    items = (functools.partial(choice, ci) for ci in range(s.n))
    return json_answer({**meta, "object": "chat.completion"}, "choices", items, {"usage": usage(out.done)},
                       gen.headers, out.size)


def _chat_lp(pieces: list, k: int) -> list[dict]:
    entries = chat_logprobs(pieces)
    for e in entries:
        e["top_logprobs"] = e["top_logprobs"][:k]
    return entries


async def stream_chat(gen: Generation, req: ChatRequest, meta: dict):
    n = req.sampling.n
    k = req.sampling.logprobs
    streams = [_ChoiceStream() for _ in range(n)]
    no_usage = {"usage": None} if req.include_usage else {}

    def chunk(ci: int, delta: dict, pieces: list | None = None, finish: str | None = None) -> bytes:
        lp = None
        if k is not None and pieces:
            lp = {"content": _chat_lp(pieces, k), "refusal": None}
        return sse({**meta, "object": "chat.completion.chunk",
                    "choices": [{"index": ci, "delta": delta, "logprobs": lp, "finish_reason": finish}], **no_usage})

    for ci in range(n):
        yield chunk(ci, {"role": "assistant", "content": ""})
    async for f in gen.frames():
        p = f.payload
        if f.kind == "TOKEN":
            pieces = streams[p["choice"]].add(p["tokens"])
            if pieces:
                yield chunk(p["choice"], {"content": "".join(x.text for x in pieces)}, pieces)
        elif f.kind == "DONE":
            gen.account(p)
            for c in sorted(p["choices"], key=lambda c: c["choice"]):
                pieces = streams[c["choice"]].flush()
                if pieces:
                    yield chunk(c["choice"], {"content": "".join(x.text for x in pieces)}, pieces)
                yield chunk(c["choice"], {}, None, c["finish_reason"])
            if req.include_usage:
                yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage(p)})
            yield b"data: [DONE]\n\n"
