"""The engine child's end of the pipe: frames out on the real stdout, frames in on a reader
thread. Shared by every engine backend, so all of them fail closed the same way."""
from __future__ import annotations

import os
import queue
import sys
import threading
import traceback

from .. import protocol as P
from .loader import log
from .submit import Refusal, run_op


class Writer:
    """Frames to the server. A failed write means the server is gone: exit at once, silently.

    A write into a full pipe that a signal interrupts (a stop and continue: job control, a
    debugger or profiler attaching) returns having written only part of the frame; the rest
    is written until the whole frame is out, so the server never reads a truncated one."""

    def __init__(self, fd: int):
        self.fd = fd
        self.lock = threading.Lock()

    def send(self, kind: str, rid: int, payload: dict) -> None:
        self.send_encoded(P.encode(kind, rid, payload))

    def send_encoded(self, frame: bytes) -> None:
        data = memoryview(frame)
        with self.lock:
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except OSError:
                os._exit(0)


def read_loop(stream, inbox: queue.Queue, out: Writer) -> None:
    """Reader thread: frames into the inbox. EOF on stdin means the server is gone: exit now,
    even in the middle of loading or of a forward pass."""
    reader = P.SyncReader(stream, "server")
    try:
        while True:
            frame = reader.read()
            if frame is None:
                os._exit(0)
            inbox.put(frame)
    except P.ProtocolViolation as e:
        log(f"protocol violation from server: {e}")
        out.send("ERROR", 0, {"code": "PROTOCOL", "message": str(e)[:1000]})
        os._exit(2)
    except OSError:
        os._exit(0)


def open_pipe() -> tuple[Writer, queue.Queue]:
    """Take the pipe over before anything else runs: the protocol owns the real stdout (fd 1
    is pointed at stderr, so a library that prints cannot corrupt it), and stdin is watched
    from the first moment, so a server that goes away while the model loads is noticed."""
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    stdin = os.fdopen(os.dup(0), "rb", buffering=1 << 16)
    out = Writer(proto_fd)
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=read_loop, args=(stdin, inbox, out), daemon=True).start()
    return out, inbox


class FrameHandler:
    """What every engine backend does with the frames it reads, whatever runs its forwards:
    SUBMIT (a generation, or a tokenizer op answered at once), CANCEL and SHUTDOWN, and a named
    ERROR for a request refused before it was accepted. A backend provides `out`, `inbox`,
    `requests`, `vocab`, `shutting_down`, `start_generate(rid, payload)` and `cancel(rid)`."""

    def poll(self) -> None:
        while True:
            try:
                frame = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.handle(frame)

    def handle(self, frame: P.Frame) -> None:
        if frame.kind == "SUBMIT":
            self.submit(frame.id, frame.payload)
        elif frame.kind == "CANCEL":
            self.cancel(frame.id)
        elif frame.kind == "SHUTDOWN":
            self.shutting_down = True

    def refuse(self, rid: int, r: Refusal) -> None:
        payload = {"code": r.code, "message": r.message[:8000]}
        if r.param:
            payload["param"] = r.param
        if r.member is not None:
            payload["member"] = r.member
        self.out.send("ERROR", rid, payload)

    def submit(self, rid: int, p: dict) -> None:
        if rid == 0 or rid in self.requests:
            self.refuse(rid, Refusal("BAD_REQUEST", "request id 0 or already in use", "id"))
            return
        if self.shutting_down:
            self.refuse(rid, Refusal("OVERLOADED", "engine is shutting down"))
            return
        try:
            if p["op"] == "generate":
                self.start_generate(rid, p)
            else:
                result = run_op(p["op"], p, self.vocab)
                try:  # encoded before anything is sent: an answer too big for DONE is refused by name
                    done = P.encode("DONE", rid, {"result": result})
                except P.FrameTooLarge:
                    raise Refusal("TOO_LARGE", "the answer would exceed the pipe's 16 MiB bound for one result",
                                  "ids" if p["op"] == "detokenize" else "members[0]",
                                  None if p["op"] == "detokenize" else 0) from None
                self.out.send("ACCEPT", rid, {"members": [{"prompt_tokens": result.get("count", 0), "cached_tokens": 0}]})
                self.out.send_encoded(done)
        except Refusal as r:
            self.refuse(rid, r)
        except Exception as e:
            log(f"request {rid} failed before acceptance: {traceback.format_exc()}")
            self.refuse(rid, Refusal("INTERNAL", f"{type(e).__name__}: {e}"))
