"""Batch jobs against the same requests sent directly, in one run on one server (issue 40).

    .venv/bin/python bench/bench_batches.py [--model default|DIR|FILE.gguf] [--lines 256]

The lines: half lm-eval-style scoring (echo + logprobs=1 + max_tokens=0 over ~40-token
texts), half greedy generation of 16 tokens. `direct` sends them all at once from as many
client threads as the engine runs sequences (--max-running, 64), `batch` uploads them as one
JSONL, creates the batch, polls it every 0.2 s and downloads the output. Reported: each
side's seconds and lines/s, and batch / direct (1.0 = a batch costs nothing over the best a
client can do by hand). Each batch answer is checked equal to its direct answer (choices and
token counts) before any time is reported.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import io
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

TEXTS = ["Question: What is the capital of France?\nAnswer: Paris is the capital and largest city.",
         "The quick brown fox jumps over the lazy dog, and then it runs back into the woods.",
         "In 1969, the first humans landed on the Moon as part of the Apollo 11 mission.",
         "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees."]


def lines(count: int, model_id: str) -> list[dict]:
    out = []
    for i in range(count):
        text = f"{TEXTS[i % len(TEXTS)]} ({i})"
        body = ({"prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0} if i % 2 == 0 else
                {"prompt": text, "max_tokens": 16, "temperature": 0})
        out.append({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model_id, **body}})
    return out


def comparable(resp: dict) -> dict:
    return {"choices": resp["choices"],
            "usage": {k: v for k, v in resp["usage"].items() if k != "prompt_tokens_details"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--lines", type=int, default=256)
    args = ap.parse_args()
    from conftest import LiveServer

    server = LiveServer(["--model", args.model], startup=600)
    try:
        http = httpx.Client(base_url=server.url, timeout=600)
        model_id = http.get("/v1/models").json()["data"][0]["id"]
        work = lines(args.lines, model_id)
        threads = 64
        with cf.ThreadPoolExecutor(threads) as pool:   # warm-up: the kernels, the tables
            list(pool.map(lambda x: http.post(x["url"], json=x["body"]).json(), work[:threads]))

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(threads) as pool:
            direct = list(pool.map(lambda x: http.post(x["url"], json=x["body"]).json(), work))
        t_direct = time.perf_counter() - t0

        t0 = time.perf_counter()
        data = b"".join(json.dumps(x).encode() + b"\n" for x in work)
        f = http.post("/v1/files", files={"file": ("b.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}).json()
        b = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                           "completion_window": "24h"}).json()
        while (b := http.get(f"/v1/batches/{b['id']}").json())["status"] not in ("completed", "failed", "cancelled"):
            time.sleep(0.2)
        out = http.get(f"/v1/files/{b['output_file_id']}/content").content
        t_batch = time.perf_counter() - t0

        got = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.splitlines())}
        assert b["status"] == "completed" and len(got) == len(work), b
        for x, d in zip(work, direct):
            assert comparable(got[x["custom_id"]]) == comparable(d), x["custom_id"]
        print(f"model {model_id}, {len(work)} lines (half score, half 16-token generation), "
              f"{threads} direct clients; every batch answer equal to its direct one")
        print(f"{'side':<8}{'s':>9}{'lines/s':>10}")
        print(f"{'direct':<8}{t_direct:>9.2f}{len(work) / t_direct:>10.1f}")
        print(f"{'batch':<8}{t_batch:>9.2f}{len(work) / t_batch:>10.1f}")
        print(f"batch / direct: {t_batch / t_direct:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
