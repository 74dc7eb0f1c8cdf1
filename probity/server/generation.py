"""One generate request's life on the server: admission, SUBMIT, ACCEPT, frames, release.

Shared by every endpoint so that the commit point (the engine's ACCEPT), cancellation on
disconnect and slot release are the same everywhere.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from starlette.requests import Request

from .engine_client import Channel
from .errors import APIError


log = logging.getLogger("probity.server")


class ClientGone(Exception):
    pass


@dataclass
class Outcome:
    """Everything the engine said about a finished request."""
    accept: dict
    echo: dict[int, list[dict]] = field(default_factory=dict)          # member -> positions
    tokens: dict[tuple[int, int], list[dict]] = field(default_factory=dict)  # (member, choice) -> entries
    done: dict | None = None
    size: int = 0  # frame payload bytes


class Generation:
    def __init__(self, svc, request: Request, payload: dict, members: int, choices: int, echo: bool):
        self.svc = svc
        self.request_id = request.state.request_id
        self.payload = payload
        self.members = members
        self.choices = choices
        self.echo = echo
        self.ch: Channel | None = None
        self.accept: dict | None = None
        self.queue_s = 0.0
        self.t0 = time.monotonic()
        self.first_token_at: float | None = None
        self.token_span: dict[tuple[int, int], list[float]] = {}  # (member, choice) -> [first, last] arrival
        self._slot = False

    async def start(self) -> dict:
        """Wait for a slot, submit, and wait for the engine's ACCEPT. Raises a named error;
        after a raise (or a cancel, when the client leaves while queued) nothing of this
        request is left anywhere. Callers run it under `until_disconnect`."""
        svc = self.svc
        try:
            deadline = asyncio.get_running_loop().time() + svc.admission.timeout
            await svc.admission.acquire()
            self._slot = True
            # A request that arrives while the engine restarts waits for it, within the
            # queue's timeout, instead of being refused: a restart is part of the design.
            await svc.engine.wait_up(deadline)
            self.queue_s = time.monotonic() - self.t0
            self.ch = await svc.engine.submit(self.payload, self.members, self.choices, self.echo)
            self.accept = await self.ch.wait_accept(svc.engine.accept_timeout)
            return self.accept
        except BaseException:
            self.close()
            raise

    async def frames(self):
        """ECHO and TOKEN frames, then the DONE payload as the last item."""
        while True:
            f = await self.ch.next()
            if f.kind == "DONE":
                yield f
                return
            if f.kind == "TOKEN":
                now = time.monotonic()
                if self.first_token_at is None:
                    self.first_token_at = now
                self.token_span.setdefault((f.payload["member"], f.payload["choice"]), [now, now])[1] = now
            yield f

    async def result(self) -> dict:
        """A tokenizer op's answer (its DONE `result`)."""
        return (await self.ch.next()).payload["result"]

    def log_stream_failure(self, response_id: str, e: APIError) -> None:
        log.error("request_id=%s response_id=%s stream ended after commit: code=%s %s",
                  self.request_id, response_id, e.code, e.message)

    async def collect(self) -> Outcome:
        """Every frame of a non-streamed answer, at most --max-response-mib of them: past that
        the engine work is cancelled and the request refused by name (a streamed answer holds
        nothing back, so it has no such bound)."""
        out = Outcome(self.accept)
        bound = self.svc.limits.max_response_bytes
        async for f in self.frames():
            out.size += f.size
            if out.size > bound:
                raise APIError("response_too_large",
                               f"the answer would exceed the server's response bound of {bound / (1 << 20):g} MiB "
                               "(--max-response-mib): ask for fewer members, tokens or logprobs, or stream it")
            p = f.payload
            if f.kind == "ECHO":
                out.echo.setdefault(p["member"], []).extend(p["positions"])
            elif f.kind == "TOKEN":
                out.tokens.setdefault((p["member"], p["choice"]), []).extend(p["tokens"])
            else:
                out.done = p
        self.account(out.done)
        return out

    def account(self, done: dict) -> None:
        self.svc.metrics.finished(self, done, time.monotonic())

    def close(self) -> None:
        """Idempotent: cancel the engine work if it is still running, free the slot."""
        if self.ch is not None:
            self.svc.engine.cancel(self.ch)
        if self._slot:
            self._slot = False
            self.svc.admission.release()


async def run_op(svc, request: Request, payload: dict) -> dict:
    """A tokenizer op (tokenize, detokenize) through admission like any request: it takes a
    slot, waits its turn in the bounded queue, and is cancelled if the client leaves."""
    gen = Generation(svc, request, payload, 1, 1, False)
    try:
        await until_disconnect(request, gen.start())
        return await until_disconnect(request, gen.result())
    finally:
        gen.close()


def check_capabilities(info: dict, *, logprobs: int | None = None, echo: bool = False, ids: bool = False,
                       seed: bool = False, chat: bool = False, members: int = 1, choices: int = 1) -> None:
    """Refuse, before any submit, what the running engine did not declare in READY."""
    caps = info["capabilities"]

    def missing(param: str, what: str) -> APIError:
        return APIError("engine_capability_missing", f"the running engine does not support {what}", param)

    if logprobs is not None and (not caps["logprobs"] or logprobs > caps["max_logprobs"]):
        raise missing("logprobs", f"logprobs={logprobs} (max {caps['max_logprobs'] if caps['logprobs'] else 'none'})")
    if echo and not caps["echo"]:
        raise missing("echo", "echo")
    if ids and not caps["token_ids"]:
        raise missing("prompt", "token-id prompts")
    if seed and not caps["seed"]:
        raise missing("seed", "seeded sampling")
    if chat and not caps["chat_template"]:
        raise missing("messages", "chat (the model has no chat template)")
    if members > caps["max_members"]:
        raise missing("prompt", f"batches of more than {caps['max_members']} members")
    if choices > caps["max_choices"]:
        raise missing("n", f"n above {caps['max_choices']}")


async def until_disconnect(request: Request, coro):
    """Run coro; if the client hangs up first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise ClientGone()


def usage(done: dict) -> dict:
    u = done["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def member_param(err: APIError, base: str, is_array: bool) -> APIError:
    """Re-attribute an engine refusal naming `members[i]` to the request's own field."""
    member = getattr(err, "member", None)
    if err.param and err.param.startswith("members"):
        err.param = f"{base}[{member}]" if (is_array and member is not None) else base
    elif err.param == "max_prompt_tokens":
        err.param = base
    return err
