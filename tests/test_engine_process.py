"""The engine child on its own: it never outlives its input or its output."""
from __future__ import annotations

import fcntl
import io
import os
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

from conftest import ROOT
from helpers import poll
from probity import protocol as P


def start_engine(model_dir) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "probity.engine", "--model", str(model_dir), "--threads", "1"],
                         cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert P.SyncReader(p.stdout, "engine").read().kind == "READY"
    return p


def test_engine_exits_when_its_input_closes(tiny_model_dir):
    p = start_engine(tiny_model_dir)
    p.stdin.close()
    assert p.wait(5) == 0
    assert p.stdout.read() == b""  # nothing written after


def test_engine_exits_when_its_output_breaks(tiny_model_dir):
    p = start_engine(tiny_model_dir)
    p.stdout.close()
    p.stdin.write(P.encode("SUBMIT", 1, {"op": "generate", "members": [{"text": "Hello"}], "max_tokens": 50}))
    p.stdin.flush()
    assert p.wait(10) == 0


def test_engine_answers_an_unreadable_frame_with_error_0_and_exits(tiny_model_dir):
    p = start_engine(tiny_model_dir)
    p.stdin.write(b"GARBAGE\n")
    p.stdin.flush()
    f = P.SyncReader(p.stdout, "engine").read()
    assert (f.kind, f.id, f.payload["code"]) == ("ERROR", 0, "PROTOCOL")
    assert p.wait(5) == 2


def test_engine_names_a_bad_submit_field_and_keeps_serving(tiny_model_dir):
    p = start_engine(tiny_model_dir)
    r = P.SyncReader(p.stdout, "engine")
    p.stdin.write(P.encode("SUBMIT", 1, {"op": "generate", "members": [{"text": "Hi"}], "temperature": "hot"}))
    p.stdin.write(P.encode("SUBMIT", 2, {"op": "generate", "members": [{"ids": [10**9]}]}))
    p.stdin.write(P.encode("SUBMIT", 3, {"op": "tokenize", "members": [{"text": "Hi"}]}))
    p.stdin.flush()
    e1, e2, a3, d3 = r.read(), r.read(), r.read(), r.read()
    assert (e1.kind, e1.payload["code"], e1.payload["param"]) == ("ERROR", "BAD_REQUEST", "temperature")
    assert (e2.kind, e2.payload["param"], e2.payload["member"]) == ("ERROR", "members[0]", 0)
    assert (a3.kind, d3.kind) == ("ACCEPT", "DONE") and d3.payload["result"]["count"] >= 1
    p.stdin.close()
    p.wait(5)


def test_cancel_takes_effect_within_a_step(tiny_model_dir):
    p = start_engine(tiny_model_dir)
    r = P.SyncReader(p.stdout, "engine")
    p.stdin.write(P.encode("SUBMIT", 1, {"op": "generate", "members": [{"text": "Hi"}], "max_tokens": 200,
                                         "n": 16, "logprobs": 32}))
    p.stdin.flush()
    assert r.read().kind == "ACCEPT"
    assert r.read().kind == "TOKEN"
    p.stdin.write(P.encode("CANCEL", 1, {}))
    p.stdin.flush()
    tokens_after = 0
    while (f := r.read()).kind in ("TOKEN", "STATS"):
        tokens_after += f.kind == "TOKEN"
    assert (f.kind, f.payload["code"]) == ("ERROR", "CANCELLED")
    assert tokens_after < 16 * 200 // 4  # stopped long before the work was done
    p.stdin.close()
    p.wait(5)


def _pipe_bytes(fd: int) -> int:
    """Bytes waiting in a pipe, unread."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def _blocked_in_pipe_write(pid: int) -> bool:
    """A thread of `pid` sleeps in the kernel's pipe write (`pipe_write`, `anon_pipe_write`)."""
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            if "pipe_write" in (t / "wchan").read_text():
                return True
        except OSError:
            pass
    return False


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class _Replay(io.RawIOBase):
    """The bytes drained during the test, then the pipe itself."""

    def __init__(self, head: bytes, fd: int):
        self.head, self.fd = memoryview(head), fd

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.head:
            n = min(len(b), len(self.head))
            b[:n], self.head = self.head[:n], self.head[n:]
            return n
        data = os.read(self.fd, len(b))
        b[:len(data)] = data
        return len(data)


def test_a_frame_survives_the_engine_being_stopped_mid_write(tiny_model_dir):
    """A write to a full pipe that a signal interrupts (a debugger or profiler attaching, a
    job-control stop) returns having written part of the frame. The engine must write the
    rest: the server would otherwise read a truncated frame and break the link.

    Each of five stops lands while a thread of the engine sleeps in a pipe write that has put
    bytes in since the previous stop (so the write returns short), as the kernel reports it:
    no sleeps, no guess at how long the echo takes."""
    p = start_engine(tiny_model_dir)   # READY read; the engine writes nothing more until SUBMIT,
    fd = p.stdout.fileno()             # so nothing is buffered in p.stdout and the fd is read directly
    members = [{"ids": [10 + (i * 7 + m) % 200 for i in range(250)]} for m in range(8)]
    p.stdin.write(P.encode("SUBMIT", 1, {"op": "generate", "members": members, "max_tokens": 1,
                                         "echo": True, "logprobs": 32}))
    p.stdin.flush()
    drained = bytearray()

    def produced() -> int:   # bytes the engine has written so far
        return len(drained) + _pipe_bytes(fd)

    mark = -1
    for _ in range(5):
        # inside a write of echo frames (~200 KB a member) that put bytes in since the last stop
        # and now waits for room: a stop here makes that write return short
        poll(lambda: produced() > mark and _blocked_in_pipe_write(p.pid), what="a blocked write with progress")
        os.kill(p.pid, signal.SIGSTOP)
        poll(lambda: _state(p.pid) == "T", what="stopped")
        mark = produced()                # frozen while it is stopped
        os.kill(p.pid, signal.SIGCONT)
        poll(lambda: _state(p.pid) != "T", what="continued")
        drained += os.read(fd, 16384)    # room: the rest of the frame goes on, fills it, blocks again
    r = P.SyncReader(io.BufferedReader(_Replay(bytes(drained), fd)), "engine")
    kinds = []
    while (f := r.read()).kind != "DONE":  # a truncated frame raises ProtocolViolation here
        kinds.append(f.kind)
        assert f.kind in ("ACCEPT", "ECHO", "TOKEN", "STATS"), f.payload
    assert kinds.count("ECHO") >= 8
    p.stdin.close()
    p.wait(5)
