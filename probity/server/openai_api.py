"""POST /v1/completions and /v1/chat/completions."""
from __future__ import annotations

import functools
import json
import time
import uuid

from typing import TYPE_CHECKING

from starlette.requests import Request

from .. import protocol as P
from .pieces import RowReports, TextBuilder, build_pieces, chat_logprobs, completion_logprobs, own_label
from .capabilities import check_capabilities
from .generation import Generation, Source
from .responses import json_answer
from .tools import ToolText, calls_of, in_use
from .validation import ChatRequest, CompletionRequest, off_loop, parse_chat, parse_completion

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
    req = await off_loop(parse_completion, body, m["id"], m["vocab_size"], svc.limits)
    s = req.sampling
    check_capabilities(info, logprobs=s.logprobs, echo=s.echo, ids=any("ids" in x for x in req.members),
                       seed=s.seed is not None, members=len(req.members), choices=s.n, grammar=s.grammar is not None,
                       distribution=s.distribution, score_tokens=bool(s.score_tokens))
    budget = svc.limits.batch_prompt_tokens if len(req.members) > 1 else None
    gen = Generation(svc, request, P.generate_payload(req.members, s, budget),
                     Source("prompt", req.is_array, req.grammar_param),
                     members=len(req.members), choices=s.n, echo=s.echo)
    await gen.start()
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": m["id"],
            "system_fingerprint": m["fingerprint"]}
    if req.stream:
        return gen.streaming(stream_completion(gen, req, meta), meta["id"])
    out = await gen.collect()
    n = s.n
    fins = {(c["member"], c["choice"]): c for c in out.done["choices"]}
    rows = RowReports.of(s, out.accept)

    def choice(mi: int, ci: int) -> dict:
        pieces = build_pieces(out.tokens.pop((mi, ci), []), out.echo.get(mi, []) if ci < n - 1 else out.echo.pop(mi, []))
        lp = None
        if s.logprobs is not None or rows.any:
            lp = completion_logprobs(pieces, 0, req.token_ids_labels, rows).as_dict()
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
    rows = RowReports.of(req.sampling, gen.accept)
    streams = [_ChoiceStream() for _ in range(n)]
    echo: list[dict] = []
    echo_sent = not req.sampling.echo
    no_usage = {"usage": None} if req.include_usage else {}  # as OpenAI: every chunk but the last says null

    def chunk(ci: int, pieces: list, finish: str | None = None) -> bytes:
        s = streams[ci]
        text = "".join(p.text for p in pieces)
        lp = None
        if k is not None or rows.any:
            lp = completion_logprobs(pieces, s.offset, req.token_ids_labels, rows).as_dict()
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
    req = await off_loop(parse_chat, body, m["id"], m["vocab_size"], svc.limits,
                         info["capabilities"].get("tool_format", "hermes"))
    s = req.sampling
    k = req.top_logprobs
    check_capabilities(info, logprobs=s.logprobs, seed=s.seed is not None, chat=True, choices=s.n,
                       grammar=s.grammar is not None, echo=s.echo, distribution=s.distribution,
                       score_tokens=bool(s.score_tokens))
    payload = P.generate_payload([{"messages": req.messages}], s,
                                 tools=req.tools.wire() if in_use(req.tools) else None)
    gen = Generation(svc, request, payload, Source("messages", grammar=req.grammar_param), choices=s.n, echo=s.echo)
    await gen.start()
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": m["id"],
            "system_fingerprint": m["fingerprint"]}
    if req.stream:
        return gen.streaming(stream_chat(gen, req, meta), meta["id"])
    out = await gen.collect()
    fins = {c["choice"]: c for c in out.done["choices"]}
    extra = {"usage": usage(out.done)}
    if req.prompt_logprobs is not None:
        extra.update(prompt_logprobs(out.echo.get(0, []), req.prompt_logprobs, s.logprobs))

    score_ids = out.accept.get("score_ids")

    def choice(ci: int) -> dict:
        pieces = build_pieces(out.tokens.pop((0, ci), []))
        lp = _chat_lp_object(pieces, k, score_ids) if k is not None else None
        text = "".join(p.text for p in pieces)
        message = {"role": "assistant", "content": text, "refusal": None}
        finish = fins[ci]["finish_reason"]
        calls = calls_of(text, req.tools, finish)
        if calls is not None:
            content, found = calls
            message.update(content=content or None, tool_calls=[
                {k2: v for k2, v in c.openai(i).items() if k2 != "index"} for i, c in enumerate(found)])
            finish = "tool_calls"
        return {"index": ci, "message": message, "logprobs": lp, "finish_reason": finish}

    items = (functools.partial(choice, ci) for ci in range(s.n))
    return json_answer({**meta, "object": "chat.completion"}, "choices", items, extra, gen.headers, out.size)


def prompt_logprobs(echo: list[dict], k: int, width: int) -> dict:
    """vLLM's prompt_logprobs shape (null for position 0, then {id: {logprob, rank,
    decoded_token}} holding the prompt's token and the top k), with the prompt's token ids and
    which of them the chat template wrote (docs/api.md). `width`: the engine's table width
    (its top `width`, plus the prompt's token when that is not among them: then its rank is
    not known, null)."""
    pieces = build_pieces([], echo)
    out = []
    for p in pieces:
        if not p.conditioned:
            out.append(None)
            continue
        table = p.top or []
        top = table if len(table) <= width else [t for t in table if t[0] != p.id]
        ranks = {tid: r + 1 for r, (tid, _, _) in enumerate(top)}
        d = {str(p.id): {"logprob": p.logprob, "rank": ranks.get(p.id), "decoded_token": own_label(p.token)}}
        for tid, h, lp in top[:k]:
            d.setdefault(str(tid), {"logprob": lp, "rank": ranks[tid], "decoded_token": own_label(bytes.fromhex(h))})
        out.append(d)
    return {"prompt_logprobs": out, "prompt_token_ids": [p.id for p in pieces],
            "prompt_template_mask": [bool(e.get("template", False)) for e in echo]}


def _chat_lp_object(pieces: list, k: int, score_ids: list[int] | None) -> dict:
    """A chat choice's (or chunk's) logprobs: each token's entry (its top k; its distribution and
    token_scores when asked), and the ids score_tokens named."""
    entries = chat_logprobs(pieces)
    for e in entries:
        e["top_logprobs"] = e["top_logprobs"][:k]
    out = {"content": entries, "refusal": None}
    if score_ids is not None:
        out["score_token_ids"] = score_ids
    return out


async def stream_chat(gen: Generation, req: ChatRequest, meta: dict):
    n = req.sampling.n
    k = req.top_logprobs
    score_ids = gen.accept.get("score_ids")
    streams = [_ChoiceStream() for _ in range(n)]
    tools = [ToolText(req.tools) if in_use(req.tools) else None for _ in range(n)]
    held_pieces: list[list] = [[] for _ in range(n)]
    no_usage = {"usage": None} if req.include_usage else {}

    def chunk(ci: int, delta: dict, pieces: list | None = None, finish: str | None = None) -> bytes:
        lp = None
        if k is not None and pieces:
            lp = _chat_lp_object(pieces, k, score_ids)
        return sse({**meta, "object": "chat.completion.chunk",
                    "choices": [{"index": ci, "delta": delta, "logprobs": lp, "finish_reason": finish}], **no_usage})

    def content(ci: int, pieces: list) -> list[bytes]:
        text = "".join(x.text for x in pieces)
        t = tools[ci]
        if t is None:
            return [chunk(ci, {"content": text}, pieces)] if pieces else []
        out = t.add(text)
        held_pieces[ci] += pieces
        chunks = []
        if out:
            sent, held_pieces[ci] = held_pieces[ci], []
            chunks.append(chunk(ci, {"content": out}, sent))
        for ev in t.events:   # a forced call's parts, as they are written
            if ev[0] == "end":
                continue
            sent, held_pieces[ci] = held_pieces[ci], []
            call = ({"index": ev[1], "id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}}
                    if ev[0] == "start" else {"index": ev[1], "function": {"arguments": ev[2]}})
            chunks.append(chunk(ci, {"tool_calls": [call]}, sent))
        t.events.clear()
        return chunks

    for ci in range(n):
        yield chunk(ci, {"role": "assistant", "content": ""})
    async for f in gen.frames():
        p = f.payload
        if f.kind == "TOKEN":
            pieces = streams[p["choice"]].add(p["tokens"])
            if pieces:
                for c in content(p["choice"], pieces):
                    yield c
        elif f.kind == "DONE":
            gen.account(p)
            for c in sorted(p["choices"], key=lambda c: c["choice"]):
                ci, finish = c["choice"], c["finish_reason"]
                pieces = streams[ci].flush()
                if pieces:
                    for out in content(ci, pieces):
                        yield out
                t = tools[ci]
                if t is not None and t.forced is not None:
                    # the calls went out as they were written; a choice cut by max_tokens keeps
                    # what it sent and says length
                    if finish == "stop" and t.forced.index >= 0:
                        finish = "tool_calls"
                    yield chunk(ci, {}, held_pieces[ci], finish)
                    continue
                if t is not None and (t.pending or held_pieces[ci]):
                    calls = calls_of(t.seen, req.tools, finish) if t.held else None
                    if calls is not None:
                        finish = "tool_calls"
                        for i, call in enumerate(calls[1]):
                            yield chunk(ci, {"tool_calls": [call.openai(i)]}, held_pieces[ci] if i == 0 else None)
                    else:
                        yield chunk(ci, {"content": t.pending}, held_pieces[ci])
                yield chunk(ci, {}, None, finish)
            if req.include_usage:
                yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage(p)})
            yield b"data: [DONE]\n\n"
