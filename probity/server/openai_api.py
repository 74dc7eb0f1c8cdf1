"""POST /v1/completions and /v1/chat/completions."""
from __future__ import annotations

import functools
import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import StreamingResponse

from .assembly import TextBuilder, build_pieces, chat_logprobs, completion_logprobs
from .errors import APIError
from .generation import Generation, check_capabilities, member_param, until_disconnect, usage
from .responses import json_answer
from .validation import CompletionRequest, parse_chat, parse_completion


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def engine_payload(members: list[dict], sampling, logprobs: int | None, echo: bool) -> dict:
    p = {"op": "generate", "members": members, **sampling.wire()}
    if logprobs is not None:
        p["logprobs"] = logprobs
    if echo:
        p["echo"] = True
    return p


async def completions(svc, request: Request, body: dict):
    info = svc.ready_info()
    m = info["model"]
    req = parse_completion(body, m["id"], m["vocab_size"], svc.limits)
    check_capabilities(info, logprobs=req.logprobs, echo=req.echo, ids=any("ids" in x for x in req.members),
                       seed=req.sampling.seed is not None, members=len(req.members), choices=req.sampling.n)
    payload = engine_payload(req.members, req.sampling, req.logprobs, req.echo)
    if len(req.members) > 1:
        payload["max_prompt_tokens"] = svc.limits.batch_prompt_tokens
    gen = Generation(svc, request, payload, len(req.members), req.sampling.n, req.echo)
    try:
        await until_disconnect(request, gen.start())
    except APIError as e:
        raise member_param(e, "prompt", req.is_array)
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": m["id"],
            "system_fingerprint": m["fingerprint"]}
    headers = {"x-queue-wait-ms": f"{gen.queue_s * 1000:.1f}"}
    if req.stream:
        return StreamingResponse(stream_completion(gen, req, meta), media_type="text/event-stream", headers=headers)
    try:
        out = await until_disconnect(request, gen.collect())
    except APIError as e:
        raise member_param(e, "prompt", req.is_array)
    finally:
        gen.close()
    n = req.sampling.n
    fins = {(c["member"], c["choice"]): c for c in out.done["choices"]}

    def choice(mi: int, ci: int) -> dict:
        pieces = build_pieces(out.tokens.pop((mi, ci), []), out.echo.get(mi, []) if ci < n - 1 else out.echo.pop(mi, []))
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(pieces, 0, req.token_ids_labels).as_dict()
        return {"index": mi * n + ci, "text": "".join(p.text for p in pieces), "logprobs": lp,
                "finish_reason": fins[(mi, ci)]["finish_reason"]}

    items = (functools.partial(choice, mi, ci) for mi in range(len(req.members)) for ci in range(n))
    return json_answer({**meta, "object": "text_completion"}, "choices", items, {"usage": usage(out.done)},
                       headers, out.size)


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
    streams = [_ChoiceStream() for _ in range(n)]
    echo: list[dict] = []
    echo_sent = not req.echo
    no_usage = {"usage": None} if req.include_usage else {}  # as OpenAI: every chunk but the last says null

    def chunk(ci: int, pieces: list, finish: str | None = None) -> bytes:
        s = streams[ci]
        text = "".join(p.text for p in pieces)
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(pieces, s.offset, req.token_ids_labels).as_dict()
        s.offset += len(text)
        return sse({**meta, "object": "text_completion",
                    "choices": [{"index": ci, "text": text, "logprobs": lp, "finish_reason": finish}], **no_usage})

    try:
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
    except APIError as e:
        gen.log_stream_failure(meta["id"], e)
    finally:
        gen.close()


async def chat_completions(svc, request: Request, body: dict):
    info = svc.ready_info()
    m = info["model"]
    req = parse_chat(body, m["id"], m["vocab_size"], svc.limits)
    k = req.top_logprobs if req.logprobs else None
    check_capabilities(info, logprobs=k, seed=req.sampling.seed is not None, chat=True, choices=req.sampling.n)
    payload = engine_payload([{"messages": req.messages}], req.sampling, k, False)
    gen = Generation(svc, request, payload, 1, req.sampling.n, False)
    try:
        await until_disconnect(request, gen.start())
    except APIError as e:
        raise member_param(e, "messages", False)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": m["id"],
            "system_fingerprint": m["fingerprint"]}
    headers = {"x-queue-wait-ms": f"{gen.queue_s * 1000:.1f}"}
    if req.stream:
        return StreamingResponse(stream_chat(gen, req, meta, k), media_type="text/event-stream", headers=headers)
    try:
        out = await until_disconnect(request, gen.collect())
    finally:
        gen.close()
    fins = {c["choice"]: c for c in out.done["choices"]}

    def choice(ci: int) -> dict:
        pieces = build_pieces(out.tokens.pop((0, ci), []))
        lp = {"content": _chat_lp(pieces, k), "refusal": None} if k is not None else None
        return {"index": ci, "message": {"role": "assistant", "content": "".join(p.text for p in pieces),
                                         "refusal": None},
                "logprobs": lp, "finish_reason": fins[ci]["finish_reason"]}

    items = (functools.partial(choice, ci) for ci in range(req.sampling.n))
    return json_answer({**meta, "object": "chat.completion"}, "choices", items, {"usage": usage(out.done)},
                       headers, out.size)


def _chat_lp(pieces: list, k: int) -> list[dict]:
    entries = chat_logprobs(pieces)
    for e in entries:
        e["top_logprobs"] = e["top_logprobs"][:k]
    return entries


async def stream_chat(gen: Generation, req, meta: dict, k: int | None):
    n = req.sampling.n
    streams = [_ChoiceStream() for _ in range(n)]
    no_usage = {"usage": None} if req.include_usage else {}

    def chunk(ci: int, delta: dict, pieces: list | None = None, finish: str | None = None) -> bytes:
        lp = None
        if k is not None and pieces:
            lp = {"content": _chat_lp(pieces, k), "refusal": None}
        return sse({**meta, "object": "chat.completion.chunk",
                    "choices": [{"index": ci, "delta": delta, "logprobs": lp, "finish_reason": finish}], **no_usage})

    try:
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
    except APIError as e:
        gen.log_stream_failure(meta["id"], e)
    finally:
        gen.close()
