"""The mixed soak of issue 29 on the default model, as long as asked: lm-eval-shaped echo arrays,
seeded sampled streams, greedy chat with top_logprobs, tokenize calls, clients that drop the
socket mid-stream and malformed bodies from many clients at once, with one SIGKILL of the
engine partway (tests/soak.py drives it; tests/test_soak.py runs a short one in `make test`).
Prints the answers by kind and status, the contract breaks (none expected), the restart time
under load, whether a probe request's floats are the same before and after, and memory.

    .venv/bin/python bench/soak.py [--seconds 150] [--clients 24] [--kill-at 75]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def main() -> None:
    from conftest import LiveServer
    from soak import Soak, server_rss, settle

    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--kill-at", type=float, default=75)
    a = ap.parse_args()
    s = LiveServer([], startup=600)
    try:
        soak = Soak(s.url, "SmolLM2-135M-Instruct", s.port)
        before, rss0 = soak.probe(), server_rss(s.proc.pid)
        marks = soak.run(a.seconds, a.clients, a.kill_at, s.engine_pid)
        h = settle(s.url)
        after, rss1 = soak.probe(), server_rss(s.proc.pid)
        counts, bad = soak.verdict(marks)
        for k, n in sorted(counts.items(), key=str):
            print(f"{k[0]:>14} {k[1]:>4} {k[2] or '':<20} {n:>6}")
        print(f"requests {sum(counts.values())}, contract breaks {len(bad)}: {bad[:5]}")
        print(f"restart under load: {marks['back'] - marks['kill']:.2f}s (kill to /health ok with the new pid)")
        print(f"probe identical before and after: {before == after}; in flight after: "
              f"{h['engine']['in_flight']}, abandoned {h['engine']['abandoned']}")
        print(f"server RSS {rss0 >> 20} -> {rss1 >> 20} MiB; engine memory (GiB) "
              + json.dumps({k: round(v / 2**30, 3) for k, v in h["engine"]["memory"].items()}))
    finally:
        s.stop()


if __name__ == "__main__":
    main()
