"""The server's side of the pipe: start and supervise the engine child, send checked frames,
validate every frame it sends back, and route each to the request it belongs to.

Any protocol violation, EOF or failed write fails every request in flight with a named
error, kills the engine and restarts it with backoff. Nothing resynchronizes on a pipe
that has once gone wrong.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

from .. import protocol as P
from ..protocol import Frame
from .errors import APIError

log = logging.getLogger("probity.engine_client")

ENGINE_CODE_MAP = {
    # engine ERROR code -> API error code (docs/api.md)
    "BAD_REQUEST": "invalid_value",
    "CONTEXT_EXCEEDED": "context_length_exceeded",
    "PROMPT_BUDGET": "prompt_batch_token_budget_exceeded",
    "OVERLOADED": "engine_unavailable",
    "TOO_LARGE": "response_too_large",
    "INTERNAL": "engine_error",
    "CANCELLED": "engine_error",
}


MAX_ABANDONED = 4096


def _pdeathsig() -> None:
    """In the child before exec: die with the server even if the server is SIGKILLed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class Channel:
    """One request's view of the pipe, and the order rules its frames must follow."""
    id: int
    members: int
    choices: int
    echo: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: bool = False
    terminal: bool = False
    abandoned: bool = False
    echo_next: dict[int, int] = field(default_factory=dict)
    tokens_started: set[int] = field(default_factory=set)

    def check(self, f: Frame) -> None:
        """Raise ProtocolViolation if f breaks this request's order."""
        if self.terminal:
            raise P.ProtocolViolation(f"{f.kind} for request {self.id} after its terminal frame")
        if f.kind == "ACCEPT":
            if self.accepted:
                raise P.ProtocolViolation(f"second ACCEPT for request {self.id}")
            if len(f.payload["members"]) != self.members:
                raise P.ProtocolViolation(f"ACCEPT for request {self.id} lists {len(f.payload['members'])} members, expected {self.members}")
            self.accepted = True
        elif f.kind in ("ECHO", "TOKEN", "DONE"):
            if not self.accepted:
                raise P.ProtocolViolation(f"{f.kind} for request {self.id} before ACCEPT")
            if f.kind != "DONE" and f.payload["member"] >= self.members:
                raise P.ProtocolViolation(f"member {f.payload['member']} out of range for request {self.id}")
            if f.kind == "ECHO":
                m = f.payload["member"]
                if not self.echo or m in self.tokens_started or f.payload["start"] != self.echo_next.get(m, 0):
                    raise P.ProtocolViolation(f"ECHO out of order for request {self.id} member {m}")
                self.echo_next[m] = f.payload["start"] + len(f.payload["positions"])
            elif f.kind == "TOKEN":
                if f.payload["choice"] >= self.choices:
                    raise P.ProtocolViolation(f"choice out of range for request {self.id}")
                m = f.payload["member"]
                if self.echo and m not in self.echo_next:
                    raise P.ProtocolViolation(f"TOKEN before ECHO for request {self.id} member {m}")
                self.tokens_started.add(m)
            else:
                self.terminal = True
        elif f.kind == "ERROR":
            self.terminal = True

    async def wait_accept(self, timeout: float) -> dict:
        """The ACCEPT payload; raises the named error if the engine refuses or never answers."""
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise APIError("engine_timeout", f"the engine did not acknowledge the request within {timeout:g}s",
                           headers={"Retry-After": "5"}) from None
        return self._unwrap(item).payload

    async def next(self) -> Frame:
        """The next ECHO/TOKEN/DONE frame; raises on ERROR or engine failure."""
        return self._unwrap(await self.queue.get())

    def _unwrap(self, item) -> Frame:
        if isinstance(item, APIError):
            raise item
        if item.kind == "ERROR":
            raise engine_error_to_api(item.payload)
        return item


def engine_error_to_api(p: dict) -> APIError:
    code = ENGINE_CODE_MAP.get(p["code"], "engine_error")
    return APIError(code, p["message"], p.get("param"), member=p.get("member"))


class EngineStartFailed(Exception):
    """The engine exited before its first READY (a model that cannot be loaded or served)."""


class EngineClient:
    def __init__(self, model: str, accept_timeout: float = 30.0, max_restarts: int = 5, frame_timeout: float = 10.0,
                 engine_args: list[str] | None = None, command: list[str] | None = None, on_ready=None,
                 on_stats=None):
        self.model = model
        self.on_ready = on_ready
        self.on_stats = on_stats
        self.accept_timeout = accept_timeout
        self.frame_timeout = frame_timeout
        self.max_restarts = max_restarts
        self.command = command or [sys.executable, "-m", "probity.engine", "--model", model, *(engine_args or [])]
        self._state = "stopped"  # starting | ready | down | restarting | failed | stopped
        self._changed: asyncio.Future | None = None  # resolved at the next change of state
        self.ready_info: dict | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.channels: dict[int, Channel] = {}
        # Requests given up on (cancelled, timed out) whose terminal frame has not come yet:
        # their late frames are still checked, then dropped. Bounded; an id evicted from here
        # that then speaks is a violation like any unknown id.
        self.abandoned: OrderedDict[int, Channel] = OrderedDict()
        self.next_id = 1
        self.restarts = 0
        self.crashes_in_row = 0
        self.last_error: str | None = None
        self.stats: dict = {}
        self._ready = asyncio.Event()
        self._start_failed = asyncio.Event()
        self.ever_ready = False
        self._reader: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self._readers: set[asyncio.Task] = set()    # read loops not finished (old engines' included)
        self._restarting: set[asyncio.Task] = set()  # restarts scheduled or under way
        self._stopping = False
        self._broken_proc: asyncio.subprocess.Process | None = None

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.state = "starting" if self.restarts == 0 else "restarting"
        self._ready.clear()
        # its own session: a terminal's signals (Ctrl-C, Ctrl-Z, Ctrl-\) reach the server's
        # process group, not the engine; the server alone decides when the engine stops, and
        # PDEATHSIG and the pipe's EOF still end it with the server
        self.proc = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            preexec_fn=_pdeathsig, start_new_session=True, limit=1 << 16)
        self._reader = asyncio.create_task(self._read_loop(self.proc))
        self._readers.add(self._reader)
        self._reader.add_done_callback(self._readers.discard)

    async def wait_first_ready(self) -> None:
        """Block until the first READY; raise if the engine dies before it. An engine that
        cannot load its model is a startup error, not something to restart forever."""
        ready = asyncio.ensure_future(self._ready.wait())
        failed = asyncio.ensure_future(self._start_failed.wait())
        await asyncio.wait({ready, failed}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        failed.cancel()
        if not self._ready.is_set():
            raise EngineStartFailed(f"the engine did not start ({self.last_error})")

    async def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        self.state = "stopped"
        if self._restart_task:
            self._restart_task.cancel()
        proc = self.proc
        if proc and proc.returncode is None:
            try:
                proc.stdin.write(P.encode("SHUTDOWN", 0, {}))
                await asyncio.wait_for(proc.stdin.drain(), 1)
                proc.stdin.close()
                await asyncio.wait_for(proc.wait(), grace)
            except (OSError, asyncio.TimeoutError, ConnectionError):
                pass
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        self._fail_all(APIError("engine_unavailable", "the server is shutting down"))

    @property
    def up(self) -> bool:
        return self.state == "ready"

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def wait_up(self, deadline: float) -> None:
        """Return once the engine is ready; while it is (re)starting, wait for it until
        `deadline` (loop time). Raises engine_unavailable (503, Retry-After) if it is not
        back by then, or at once if it failed for good or the server is stopping."""
        loop = asyncio.get_running_loop()
        while self.state != "ready":
            left = deadline - loop.time()
            if self.state in ("failed", "stopped") or left <= 0:
                raise self.unavailable()
            if self._changed is None:
                self._changed = loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._changed), left)
            except asyncio.TimeoutError:
                pass

    def _broken(self, reason: str, proc) -> None:
        """The pipe to `proc` cannot be trusted any more. Acts once per process: a failed
        write and the EOF that follows it are one failure, with one restart."""
        if proc is not self.proc or proc is self._broken_proc or self.state == "stopped":
            return
        self._broken_proc = proc
        if self.ever_ready:  # before the first READY the engine's own line says what went wrong
            log.error("engine link broken: %s", reason)
        self.last_error = reason
        self.state = "down"
        self._ready.clear()
        self._fail_all(APIError("engine_error", f"the engine failed: {reason}"))
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        if not self.ever_ready:
            self.state = "failed"
            self._start_failed.set()
            return
        if not self._stopping:
            self._restart_task = asyncio.create_task(self._restart())
            self._restarting.add(self._restart_task)
            self._restart_task.add_done_callback(self._restarting.discard)

    def _fail_all(self, err: APIError) -> None:
        self.abandoned.clear()
        channels, self.channels = self.channels, {}
        for ch in channels.values():
            ch.terminal = True
            ch.queue.put_nowait(err)

    async def _restart(self) -> None:
        self.crashes_in_row += 1
        if self.crashes_in_row > self.max_restarts:
            self.state = "failed"
            log.error("engine crashed %d times in a row; not restarting", self.crashes_in_row - 1)
            return
        self.state = "restarting"
        delay = min(0.25 * 2 ** (self.crashes_in_row - 1), 8.0)
        await asyncio.sleep(delay)
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()
        self.restarts += 1
        await self.start()

    # ------------------------------------------------------------ reading
    async def _read_loop(self, proc) -> None:
        reader = P.AsyncReader(proc.stdout, "engine", self.frame_timeout)
        try:
            while True:
                frame = await reader.read()
                if frame is None:
                    await proc.wait()
                    self._broken(f"engine exited (status {proc.returncode})", proc)
                    return
                self._dispatch(frame)
        except P.ProtocolViolation as e:
            self._broken(f"protocol violation: {e}", proc)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let the reader die silently
            self._broken(f"reader failed: {type(e).__name__}: {e}", proc)

    def _dispatch(self, f: Frame) -> None:
        kind = P.KINDS[f.kind]
        if kind.reserved:
            return  # group-scoring channel: drained (already bounded and checked), no effect
        if f.id == 0:
            if f.kind == "READY" and self.state in ("starting", "restarting"):
                if f.payload["protocol"] != P.PROTOCOL_VERSION:
                    raise P.ProtocolViolation(f"engine speaks protocol {f.payload['protocol']}")
                self.ready_info = f.payload
                self.state = "ready"
                self.crashes_in_row = 0
                self.ever_ready = True
                self._ready.set()
                if self.on_ready:
                    self.on_ready(f.payload)
                log.info("engine ready: %s", f.payload["model"]["id"])
            elif f.kind == "STATS":
                self.stats = f.payload
                if self.on_stats:
                    self.on_stats(f.payload)
            elif f.kind == "ERROR":
                raise P.ProtocolViolation(f"engine reported {f.payload['code']}: {f.payload['message']}")
            else:
                raise P.ProtocolViolation(f"unexpected {f.kind} for id 0")
            return
        if f.kind == "READY" or f.kind == "STATS":
            raise P.ProtocolViolation(f"{f.kind} with a request id")
        ch = self.channels.get(f.id) or self.abandoned.get(f.id)
        if ch is None:
            raise P.ProtocolViolation(f"{f.kind} for request {f.id}, which is not in flight")
        ch.check(f)
        if ch.abandoned:
            if ch.terminal:
                del self.abandoned[f.id]
            return
        if ch.terminal:
            del self.channels[f.id]
        ch.queue.put_nowait(f)

    # ------------------------------------------------------------ writing
    async def _write(self, data: bytes) -> None:
        proc = self.proc
        try:
            if proc is None or proc.stdin.is_closing():
                raise ConnectionError("engine stdin is closed")
            proc.stdin.write(data)
            await proc.stdin.drain()
        except (OSError, ConnectionError, RuntimeError) as e:
            self._broken(f"write to engine failed: {e}", proc)
            raise APIError("engine_error", f"could not send the request to the engine: {e}") from None

    async def submit(self, payload: dict, members: int = 1, choices: int = 1, echo: bool = False) -> Channel:
        if self.state != "ready":
            raise self.unavailable()
        rid = self.next_id
        self.next_id += 1
        # Encode before the channel exists: a payload that cannot become a frame leaves nothing behind.
        try:
            frame = P.encode("SUBMIT", rid, payload)
        except P.FrameTooLarge as e:  # beyond SUBMIT's bound (a --max-body above it): the request's size
            raise APIError("request_too_large", f"the request is too large for the engine pipe: {e}") from None
        ch = Channel(rid, members, choices, echo)
        self.channels[rid] = ch
        try:
            await self._write(frame)
        except APIError:
            self.channels.pop(rid, None)
            raise
        return ch

    def unavailable(self) -> APIError:
        what = {"failed": "the engine failed repeatedly and is not being restarted",
                "starting": "the engine is starting", "restarting": "the engine is restarting",
                "down": "the engine is down"}.get(self.state, f"the engine is {self.state}")
        return APIError("engine_unavailable", what, headers={"Retry-After": "2"})

    def cancel(self, ch: Channel) -> None:
        """Abandon a request: its later frames are still read and checked, then dropped."""
        if ch.terminal or ch.abandoned:
            return
        ch.abandoned = True
        if self.channels.get(ch.id) is ch:
            del self.channels[ch.id]
            self.abandoned[ch.id] = ch
            while len(self.abandoned) > MAX_ABANDONED:
                self.abandoned.popitem(last=False)
            asyncio.get_running_loop().create_task(self._cancel_write(ch.id))

    async def _cancel_write(self, rid: int) -> None:
        try:
            await self._write(P.encode("CANCEL", rid, {}))
        except APIError:
            pass

    def health(self) -> dict:
        return {"state": self.state, "restarts": self.restarts, "last_error": self.last_error,
                "in_flight": len(self.channels), "abandoned": len(self.abandoned), "stats": self.stats,
                "memory": (self.ready_info or {}).get("memory"),
                "pid": self.proc.pid if self.proc else None,
                "readers": len(self._readers), "restart_pending": bool(self._restarting)}
