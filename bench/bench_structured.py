"""The mask's cost (issue 28): 32 concurrent streamed chat requests constrained by a JSON schema
against 32 unconstrained ones, on a running server, in one run; generated tokens per second of
wall time each way, and the ratio. Alternates the two kinds `--reps` times.

    .venv/bin/python bench/bench_structured.py --url http://127.0.0.1:8000 [--reps 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, constrained: bool, max_tokens: int) -> int:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "seed": i, "temperature": 1.0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Describe person number {i} as JSON with name, age, city, tags."}]}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                if d.get("usage"):
                    tokens = d["usage"]["completion_tokens"]
    return tokens


async def wave(url: str, model: str, constrained: bool, n: int, max_tokens: int) -> tuple[int, float]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(client, url, model, i, constrained, max_tokens) for i in range(n)))
        return sum(counts), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    asyncio.run(wave(a.url, model, True, 4, 8))  # warm: the schema compiled, the tokenizer view built
    rows = {True: [], False: []}
    for _ in range(a.reps):
        for constrained in (False, True):
            tok, dt = asyncio.run(wave(a.url, model, constrained, a.streams, a.max_tokens))
            rows[constrained].append((tok, dt))
    print(f"| kind | streams | tokens | wall s | tokens/s |\n|---|---|---|---|---|")
    rate = {}
    for constrained, runs in rows.items():
        tok, dt = sum(t for t, _ in runs), sum(d for _, d in runs)
        rate[constrained] = tok / dt
        print(f"| {'json_schema' if constrained else 'unconstrained'} | {a.streams} | {tok} | {dt:.1f} | {tok / dt:.1f} |")
    print(f"\nconstrained / unconstrained tokens/s: {rate[True] / rate[False]:.3f}")


if __name__ == "__main__":
    main()
