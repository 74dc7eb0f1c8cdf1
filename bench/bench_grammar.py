"""What a hostile or heavy grammar costs everyone else (issue 41), on a running server (start it
with `--grammar-cache-mib 64` to see the cache bound bite; its engine's pid is read from /health):

1. a plain 8-token completion's latency alone, then while a 100,000-choice request is refused,
   then while an allowed grammar that takes seconds to compile is checked and compiled
   (4,000 optional properties: give the server `--grammar-max-properties 100000` for it, or it
   is refused at once and the row says so) -- medians and the ratio to alone;
2. a soak: `--soak` distinct allowed grammars (600-entry choice lists, ~1.5 MB compiled each)
   beside a streaming request; the engine's resident memory before and after, and its
   grammar cache's bytes and entries, against the bound READY states.

    .venv/bin/python bench/bench_grammar.py --url http://127.0.0.1:8000 [--soak 1000]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import tempfile
import time

import httpx


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def plain_latencies(url: str, model: str, until=None, n: int = 20) -> list[float]:
    body = {"model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    out = []
    while (until is None and len(out) < n) or (until is not None and not until.done()):
        t = time.perf_counter()
        httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
        out.append(time.perf_counter() - t)
    return out


def beside(url: str, model: str, body: dict, times: int) -> tuple[list[float], str, float]:
    """Plain latencies while `body` is sent `times` times in a row by curl, a process of its own
    (in this one, the upload would hold the bench's GIL beside the plain requests it times)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".json") as f:
        f.write(json.dumps(body).encode())
        f.flush()
        loop = (f"for i in $(seq {times}); do curl -s -o /dev/null -w '%{{http_code}}\\n' "
                f"-H 'content-type: application/json' --data-binary @{f.name} {url}/v1/chat/completions; done")
        t = time.perf_counter()
        heavy = subprocess.Popen(["bash", "-c", loop], stdout=subprocess.PIPE, text=True)

        class Running:
            def done(self):
                return heavy.poll() is not None
        lat = plain_latencies(url, model, until=Running())
        codes = heavy.stdout.read().split()
        return lat, ",".join(sorted(set(codes))), (time.perf_counter() - t) / times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--soak", type=int, default=1000)
    a = ap.parse_args()
    url = a.url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    alone = plain_latencies(url, model)
    base = statistics.median(alone)
    print(f"plain 8-token completion alone: median {base * 1e3:.1f} ms, max {max(alone) * 1e3:.1f} ms")
    print("| beside | its status | its time (each) | plain requests meanwhile | median | max | median / alone |")
    print("|---|---|---|---|---|---|---|")
    choices = {**chat, "structured_outputs": {"choice": [f"option {i}" for i in range(100_000)]}}
    cases = {
        # the same 1.6 MB body refused before any grammar work (another model's name): what
        # receiving and parsing it costs, whatever it holds
        "the same body, refused for its model": {**choices, "model": "not-this-one"},
        "100,000 choices": choices,
        "4,000 optional properties": {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "slow", "schema": {"type": "object", "properties": {
                f"p{i}": {"type": "integer"} for i in range(4000)}}}}},
    }
    for name, body in cases.items():
        # a refusal is quick: sent 20 times in a row, so plain requests run beside many of them
        lat, status, took = beside(url, model, body, 1 if name.startswith("4,000") else 20)
        med = statistics.median(lat) if lat else float("nan")
        print(f"| {name} | {status} | {took:.2f} s | {len(lat)} | {med * 1e3:.1f} ms | "
              f"{max(lat, default=float('nan')) * 1e3:.1f} ms | {med / base:.2f} |")

    if a.soak:
        health = httpx.get(url + "/health").json()["engine"]
        pid, bound = health["pid"], health.get("memory", {}).get("grammar_cache_max")
        stream = {"model": model, "prompt": "Once", "max_tokens": 1000, "stream": True, "temperature": 0}
        for i in range(20):   # the heap's high-water mark first
            httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 1, "structured_outputs": {
                "choice": [f"warm {i} option {j}" for j in range(600)]}}, timeout=120).raise_for_status()
        before = rss(pid)
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(httpx.post, url + "/v1/completions", json=stream, timeout=900)
            for i in range(a.soak):
                httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 1, "structured_outputs": {
                    "choice": [f"{i} option {j}" for j in range(600)]}}, timeout=120).raise_for_status()
            streaming.result().raise_for_status()
        took = time.perf_counter() - t
        after = rss(pid)
        cached = metric(url, "probity_engine_grammar_cache_bytes")
        entries = metric(url, "probity_engine_grammar_cache_entries")
        print(f"\nsoak: {a.soak} distinct grammars in {took:.1f} s beside a stream; engine resident "
              f"{before / 2**20:.0f} -> {after / 2**20:.0f} MiB (+{(after - before) / 2**20:.0f}); cache "
              f"{(cached or 0) / 2**20:.1f} MiB in {entries:.0f} grammars, bound {(bound or 0) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
