"""One engine request's life on the server, written once for every endpoint: a slot in the
admission queue, SUBMIT, the engine's ACCEPT (the commit point: nothing is sent to the
client before it), then its frames streamed or collected, and release on every exit path —
an answer, a refusal, a failure, or a client that hangs up."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..protocol import Frame
from .engine_client import Channel
from .errors import APIError

if TYPE_CHECKING:
    from .service import Service

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


@dataclass(frozen=True)
class Source:
    """The request field the SUBMIT's members came from, so an engine refusal that names
    `members[i]` (or a detokenize's `ids`) names the client's own field."""
    param: str                 # "prompt", "messages", "tokens"
    is_array: bool = False     # a prompt array: a member's refusal names prompt[i]
    grammar: str | None = None  # the request field its grammar came from (response_format..., tool_choice)

    def attribute(self, err: APIError) -> APIError:
        if err.param == "grammar" and self.grammar:
            err.param = self.grammar
            if err.code == "invalid_value":   # the engine's compile: the server's own code for it
                err.code = "invalid_grammar"
            return err
        if err.param and (err.param.startswith("members") or err.param in ("max_prompt_tokens", "ids")):
            err.param = (f"{self.param}[{err.member}]" if self.is_array and err.member is not None
                         else self.param)
        return err


class Generation:
    def __init__(self, svc: "Service", request: Request, payload: dict, source: Source, members: int = 1,
                 choices: int = 1, echo: bool = False):
        self.svc = svc
        self.request = request
        self.request_id = request.state.request_id
        self.payload = payload
        self.source = source
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

    @property
    def headers(self) -> dict[str, str]:
        return {"x-queue-wait-ms": f"{self.queue_s * 1000:.1f}"}

    async def start(self) -> dict:
        """Wait for a slot, submit, and wait for the engine's ACCEPT (its payload). Raises a
        named error, or ClientGone; after a raise nothing of this request is left anywhere."""
        try:
            return await self._watched(self._start())
        except BaseException:
            self.close()
            raise

    async def _start(self) -> dict:
        svc = self.svc
        deadline = asyncio.get_running_loop().time() + svc.admission.timeout
        await svc.admission.acquire()
        self._slot = True
        # A request that arrives while the engine restarts waits for it, within the queue's
        # timeout, instead of being refused: a restart is part of the design.
        await svc.engine.wait_up(deadline)
        self.queue_s = time.monotonic() - self.t0
        self.ch = await svc.engine.submit(self.payload, self.members, self.choices, self.echo)
        self.accept = await self.ch.wait_accept(svc.engine.accept_timeout)
        return self.accept

    async def _watched(self, coro):
        """Run coro while watching for the client to hang up (then it is cancelled and
        ClientGone raised); an engine refusal names the client's own field."""
        try:
            return await until_disconnect(self.request, coro)
        except APIError as e:
            raise self.source.attribute(e)

    async def frames(self) -> AsyncIterator[Frame]:
        """ECHO and TOKEN frames, then the DONE frame as the last item."""
        while True:
            f = await self.ch.next()
            if f.kind == "TOKEN":
                now = time.monotonic()
                if self.first_token_at is None:
                    self.first_token_at = now
                self.token_span.setdefault((f.payload["member"], f.payload["choice"]), [now, now])[1] = now
            yield f
            if f.kind == "DONE":
                return

    async def collect(self) -> Outcome:
        """Every frame of a non-streamed answer, at most --max-response-mib of them: past that
        the engine work is cancelled and the request refused by name (a streamed answer holds
        nothing back, so it has no such bound). Releases the request whatever happens."""
        try:
            return await self._watched(self._collect())
        finally:
            self.close()

    async def _collect(self) -> Outcome:
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

    async def result(self) -> dict:
        """A tokenizer op's answer (its DONE `result`). Releases the request."""
        try:
            return (await self._watched(self.ch.next())).payload["result"]
        finally:
            self.close()

    def streaming(self, events: AsyncIterator[bytes], response_id: str,
                  on_failure: Callable[[APIError], bytes] | None = None) -> StreamingResponse:
        """The committed answer as server-sent events. A failure after the commit ends the
        stream cleanly (with `on_failure`'s last event, where the API has one) and is logged."""
        async def body():
            try:
                async for chunk in events:
                    yield chunk
            except APIError as e:
                log.error("request_id=%s response_id=%s stream ended after commit: code=%s %s",
                          self.request_id, response_id, e.code, e.message)
                if on_failure is not None:
                    yield on_failure(e)
            finally:
                await events.aclose()
                self.close()
        return StreamingResponse(body(), media_type="text/event-stream", headers=self.headers)

    def account(self, done: dict) -> None:
        self.svc.metrics.finished(self, done, time.monotonic())

    def close(self) -> None:
        """Idempotent: cancel the engine work if it is still running, free the slot."""
        if self.ch is not None:
            self.svc.engine.cancel(self.ch)
        if self._slot:
            self._slot = False
            self.svc.admission.release()


async def run_op(svc: "Service", request: Request, payload: dict, source: Source) -> dict:
    """A tokenizer op (tokenize, detokenize) through admission like any request: it takes a
    slot, waits its turn in the bounded queue, and is cancelled if the client leaves."""
    gen = Generation(svc, request, payload, source)
    await gen.start()
    return await gen.result()


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
