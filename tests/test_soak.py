"""The mixed soak (tests/soak.py) on both backends: every answer is a 200, a named 400 for the
client faults (also while the engine restarts), or engine_error only for what was in flight
when the engine was killed; nothing left in flight; the same floats before and after; the
server's memory bounded."""
from __future__ import annotations

import pytest

from conftest import TINY_ID, LiveServer, tiny_args
from soak import Soak, server_rss, settle


def run_soak(server: LiveServer, model: str, seconds: float, clients: int, kill_at: float) -> None:
    soak = Soak(server.url, model, server.port)
    before, rss0 = soak.probe(), server_rss(server.proc.pid)
    marks = soak.run(seconds, clients, kill_at, server.engine_pid)
    h = settle(server.url)
    after, rss1 = soak.probe(), server_rss(server.proc.pid)
    counts, bad = soak.verdict(marks)
    summary = {f"{k[0]} {k[1]} {k[2] or ''}".strip(): n for k, n in sorted(counts.items(), key=str)}
    print(summary, f"restart {marks['back'] - marks['kill']:.2f}s")
    assert not bad, (bad[:10], summary)
    for kind in ("echo_array", "seeded_stream", "greedy_chat", "tokenize"):
        assert counts[(kind, 200, None)] > 0, summary  # every kind ran and was answered
    assert counts[("malformed", 400, "invalid_json")] + counts[("malformed", 400, "invalid_value")] > 0
    assert (h["status"], h["engine"]["in_flight"], h["engine"]["abandoned"], h["active"], h["queued"]) == \
        ("ok", 0, 0, 0, 0), h
    assert h["engine"]["restarts"] >= 1
    assert before == after  # bit-identical across the load and the restart
    assert rss1 - rss0 < 150 << 20, (rss0, rss1)


def test_soak_on_probitys_engine(servers, tiny_model_dir):
    s = servers.fresh(tiny_args(tiny_model_dir))   # its engine is SIGKILLed: not the shared tiny server
    try:
        run_soak(s, TINY_ID, seconds=30, clients=8, kill_at=12)
    finally:
        s.stop()


@pytest.mark.vllm
@pytest.mark.default_model
def test_soak_on_the_vllm_backend(vllm_server):
    run_soak(vllm_server, "SmolLM2-135M-Instruct", seconds=15, clients=4, kill_at=5)
