"""Checking a grammar by compiling it, beside the server, never on its event loop: a worker
process compiles it as the engine will (llguidance, the same parser limits) over a byte-level
vocabulary, and computes its first mask, under a time limit and a memory limit of its own. A
grammar that runs past either is a named 400 `grammar_too_large`; the worker is then replaced,
and the server and the engine never noticed. Verdicts are cached by the grammar's text, bounded
in bytes. The counted bounds (grammar_bounds.py) come first: this is for what they did not
foresee. docs/api.md, Grammar bounds."""
from __future__ import annotations

import collections
import json
import os
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ..protocol import grammar_limits, grammar_reason
from .grammar_bounds import Bounds

OK, INVALID, TOO_LARGE = "ok", "invalid", "too_large"
STARTUP_S = 30.0   # a new worker's import of llguidance, before its first grammar
POLL_S = 0.02      # how often a compile's CPU time is read
WALL_FACTOR = 10   # a compile is ended past this many times its CPU limit in wall time, whatever its CPU
NICE = 10          # the worker's priority: below the engine's and the server's, which share the cores


@dataclass(frozen=True)
class Verdict:
    kind: str            # OK, INVALID (the library's reason) or TOO_LARGE (a worker limit)
    reason: str = ""


@dataclass
class GrammarCheck:
    """The server's whole policy for a request's grammar: the counted bounds, then a compile
    in the worker. `verify` blocks (call it off the event loop); it is thread-safe."""
    bounds: Bounds = field(default_factory=Bounds)
    seconds: float = 10.0         # --grammar-compile-seconds
    mib: int = 1024               # --grammar-compile-mib
    cache_bytes: int = 64 << 20   # verdicts kept, counted by the grammars' text

    def __post_init__(self):
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._verdicts: collections.OrderedDict[str, Verdict] = collections.OrderedDict()
        self.cached_bytes = 0
        self.compiled = 0          # grammars the worker compiled
        self.workers_replaced = 0  # workers ended by a limit (or a crash) and replaced

    def start(self) -> None:
        """Start the worker now (it imports llguidance: ~0.5 s), so a first grammar waits less."""
        with self._lock:
            if self._worker is None:
                self._worker = _Worker(self.mib)

    def verify(self, grammar: str) -> Verdict:
        with self._lock:
            v = self._verdicts.get(grammar)
            if v is not None:
                self._verdicts.move_to_end(grammar)
                return v
            if self._worker is None:
                self._worker = _Worker(self.mib)
            try:
                v = self._worker.compile(grammar, self.seconds)
            except WorkerFailed:   # the server's fault, not the grammar's: a 500, and a new worker next time
                self._worker.close()
                self._worker = None
                raise
            self.compiled += 1
            if v.kind == TOO_LARGE:   # the worker was killed or died: a fresh one for the next grammar
                self._worker.close()
                self._worker = None
                self.workers_replaced += 1
                if v.reason == "memory":
                    v = Verdict(TOO_LARGE, f"compiling it needs more than {self.mib} MiB "
                                           "(the server's --grammar-compile-mib)")
                else:
                    v = Verdict(TOO_LARGE, f"compiling it takes longer than {self.seconds:g} s "
                                           "(the server's --grammar-compile-seconds)")
            self._remember(grammar, v)
            return v

    def _remember(self, grammar: str, v: Verdict) -> None:
        cost = _cost(grammar, v)
        if cost > self.cache_bytes:
            return
        self._verdicts[grammar] = v
        self.cached_bytes += cost
        while self.cached_bytes > self.cache_bytes:
            g, old = self._verdicts.popitem(last=False)
            self.cached_bytes -= _cost(g, old)

    @property
    def cached(self) -> int:
        return len(self._verdicts)

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None


def _cost(grammar: str, v: Verdict) -> int:
    return len(grammar.encode()) + len(v.reason) + 200


class WorkerFailed(RuntimeError):
    pass


class _Worker:
    """One compile process (this module run as a program) and the pipes to it: a grammar's
    UTF-8 text in, a JSON verdict out, each after its 4-byte length."""

    def __init__(self, mib: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "probity.server.grammar_check", str(mib)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     close_fds=True)
        self.ready = False

    def compile(self, grammar: str, seconds: float) -> Verdict:
        try:
            if not self.ready:  # it says so once it has imported llguidance: that is not the grammar's time
                if not select.select([self.proc.stdout], [], [], STARTUP_S)[0] or _read(self.proc.stdout) != b"ready":
                    raise WorkerFailed("the grammar worker did not start")
                self.ready = True
            start, t0 = self.cpu_seconds(), time.monotonic()
            _write(self.proc.stdin, grammar.encode())
            # the limit is the compile's own CPU time, so the verdict does not depend on what else
            # the machine runs (the worker runs at a low priority); wall time is capped too
            while not select.select([self.proc.stdout], [], [], POLL_S)[0]:
                if self.cpu_seconds() - start > seconds or time.monotonic() - t0 > WALL_FACTOR * seconds:
                    return Verdict(TOO_LARGE, "time")
            kind, reason = json.loads(_read(self.proc.stdout))
            return Verdict(kind, reason)
        except (EOFError, OSError, ValueError):  # it died: an allocation past its limit aborts it
            return Verdict(TOO_LARGE, "memory")

    def cpu_seconds(self) -> float:
        """The worker's user and system time so far (/proc/<pid>/stat)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self.proc.stdin.close()
        self.proc.stdout.close()


def _write(f, data: bytes) -> None:
    f.write(struct.pack("<I", len(data)) + data)
    f.flush()


def _read(f) -> bytes:
    head = f.read(4)
    if len(head) < 4:
        raise EOFError
    n = struct.unpack("<I", head)[0]
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return data


# ------------------------------------------------------------ the worker process
class _ByteVocabulary:
    """A vocabulary of the 256 bytes and an end token: llguidance's mask over it decides the same
    grammar questions as over a model's tokens (can it begin, does it compile), with no model."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s)


def _serve(mib: int) -> None:
    import llguidance

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.nice(NICE)
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))
    limits = grammar_limits()
    _verdict(llguidance, tok, llguidance.LLMatcher.grammar_from_regex("warm"), limits)
    # what it holds now, plus the budget; an allocation past it aborts this process alone
    resource.setrlimit(resource.RLIMIT_AS, (_virtual_bytes() + (mib << 20), resource.RLIM_INFINITY))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    _write(stdout, b"ready")
    while True:
        try:
            grammar = _read(stdin).decode()
        except EOFError:
            return
        _write(stdout, json.dumps(_verdict(llguidance, tok, grammar, limits)).encode())


def _verdict(llguidance, tok, grammar: str, limits) -> tuple[str, str]:
    try:
        m = llguidance.LLMatcher(tok, grammar, log_level=0, limits=limits)
        if m.is_error():
            return INVALID, grammar_reason(m.get_error())
        if not any(m.compute_bitmask()) or m.is_error():
            return INVALID, "the grammar admits no output: " + grammar_reason(m.get_error() or "no token can begin it")
        return OK, ""
    except MemoryError:
        os._exit(1)
    except BaseException as e:  # noqa: BLE001 -- a Rust panic arrives as a BaseException
        return INVALID, grammar_reason(str(e))


def _virtual_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
