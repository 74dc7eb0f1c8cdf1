"""The engine child on its own: it never outlives its input or its output."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import ROOT
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


def test_a_frame_survives_the_engine_being_stopped_mid_write(tiny_model_dir):
    """A write to a full pipe that a signal interrupts (a debugger or profiler attaching, a
    job-control stop) returns having written part of the frame. The engine must write the
    rest: the server would otherwise read a truncated frame and break the link."""
    p = start_engine(tiny_model_dir)
    r = P.SyncReader(p.stdout, "engine")
    members = [{"ids": [10 + (i * 7 + m) % 200 for i in range(250)]} for m in range(8)]
    p.stdin.write(P.encode("SUBMIT", 1, {"op": "generate", "members": members, "max_tokens": 1,
                                         "echo": True, "logprobs": 32}))
    p.stdin.flush()
    # nobody reads: the engine fills the pipe (64 KiB) and blocks inside a write of echo frames
    # (~200 KB a member); stop and continue it there, several times
    for _ in range(5):
        time.sleep(1.0)
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.05)
        os.kill(p.pid, signal.SIGCONT)
    kinds = []
    while (f := r.read()).kind != "DONE":  # a truncated frame raises ProtocolViolation here
        kinds.append(f.kind)
        assert f.kind in ("ACCEPT", "ECHO", "TOKEN", "STATS"), f.payload
    assert kinds.count("ECHO") >= 8
    p.stdin.close()
    p.wait(5)
