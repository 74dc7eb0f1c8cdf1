"""The engine child's end of the pipe: frames out on the real stdout, frames in on a reader
thread. Shared by every engine backend, so all of them fail closed the same way."""
from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading

from .. import protocol as P
from .log import log
from .work import Refusal


class Writer:
    """Frames to the server. A failed write means the server is gone: exit at once, silently.

    A write into a full pipe that a signal interrupts (a stop and continue: job control, a
    debugger or profiler attaching) returns having written only part of the frame; the rest
    is written until the whole frame is out, so the server never reads a truncated one."""

    def __init__(self, fd: int):
        self.fd = fd
        self.lock = threading.Lock()
        self.held_frames: list[bytes] | None = None   # frames kept for one write (held()): the holder's only
        self.holder: int | None = None

    def send(self, kind: str, rid: int, payload: dict) -> None:
        self.send_encoded(P.encode(kind, rid, payload))

    @contextlib.contextmanager
    def held(self):
        """The frames this thread sends inside go out in one write when it ends (an engine step's
        TOKEN frames: one system call instead of one per choice, and one wake-up of the server,
        which shares the CPU), in the order they were sent, whatever ends it."""
        self.held_frames, self.holder = [], threading.get_ident()
        try:
            yield
        finally:
            frames, self.held_frames, self.holder = self.held_frames, None, None
            if frames:
                self._write(b"".join(frames))

    def send_encoded(self, frame: bytes) -> None:
        if self.holder == threading.get_ident():
            self.held_frames.append(frame)
            return
        self._write(frame)

    def _write(self, frame: bytes) -> None:
        data = memoryview(frame)
        with self.lock:
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except OSError:
                os._exit(0)


class Refused:
    """An inbox item: a SUBMIT whose framing was sound but a field of which its schema refused.
    The engine answers it with ERROR BAD_REQUEST naming the field; the pipe is still in step."""

    def __init__(self, rid: int, refusal: Refusal):
        self.id, self.refusal = rid, refusal


def read_loop(stream, inbox: queue.Queue, out: Writer) -> None:
    """Reader thread: frames into the inbox. EOF on stdin means the server is gone: exit now,
    even in the middle of loading or of a forward pass."""
    reader = P.SyncReader(stream, "server")
    try:
        while True:
            try:
                frame = reader.read()
            except P.SchemaError as e:
                if e.kind != "SUBMIT":
                    raise
                inbox.put(Refused(e.id, Refusal.bad_field(e)))
                continue
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
