"""Side-by-side benchmark: probity over HTTP vs raw in-process transformers/torch on the same
model, in one run, reported as ratios (probity time / raw time; 1.0 = no overhead).

    .venv/bin/python bench/bench_logprobs.py [--model default|DIR|FILE.gguf] [--reps 3]

Workloads:
  score     lm-eval-style scoring: echo + logprobs=1 + max_tokens=0 over 8 prompts
  generate  greedy generation of 64 tokens from one prompt
  concurrent 4 generation requests of 32 tokens at once (probity) vs the same 4 one after
            another in-process (raw torch has no server to overlap them in)
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Question: What is the capital of France?\nAnswer: Paris",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "In 1969, the first humans landed on the Moon as part of the Apollo 11 mission.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Ça coûte 5€, n'est-ce pas ? Oui, c'est très cher pour un café.",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.",
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
    "The mitochondria is the powerhouse of the cell, producing ATP through respiration.",
]


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def raw_side(model_arg: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from probity.engine.loader import converted_dir, resolve

    path, model_id = resolve(model_arg)
    folder = converted_dir(path)[0] if path.is_file() else path   # raw torch needs float32 weights
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)

    @torch.inference_mode()
    def score():
        for p in PROMPTS:
            ids = torch.tensor([tok(p)["input_ids"]])
            lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            lp[:-1].gather(1, ids[0, 1:, None])
            torch.topk(lp[:-1], 1, dim=-1)

    @torch.inference_mode()
    def generate(n=64, prompt=PROMPTS[2]):
        from transformers import DynamicCache

        cache = DynamicCache()
        out = model(torch.tensor([tok(prompt)["input_ids"]]), cache=cache, use_cache=True, logits_to_keep=1)
        t = int(out.logits[0, -1].argmax())
        for _ in range(n - 1):
            out = model(torch.tensor([[t]]), cache=out.cache, use_cache=True)
            t = int(out.logits[0, -1].argmax())

    def concurrent():
        for p in PROMPTS[:4]:
            generate(32, p)

    return model_id, {"score": score, "generate": generate, "concurrent": concurrent}


def server_side(url: str, model_id: str):
    client = httpx.Client(base_url=url, timeout=300)

    def post(body):
        r = client.post("/v1/completions", json={"model": model_id, **body})
        r.raise_for_status()
        return r.json()

    def score():
        for p in PROMPTS:
            post({"prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1})

    def generate():
        post({"prompt": PROMPTS[2], "max_tokens": 64, "temperature": 0})

    def concurrent():
        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: post({"prompt": p, "max_tokens": 32, "temperature": 0}), PROMPTS[:4]))

    return {"score": score, "generate": generate, "concurrent": concurrent}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from conftest import LiveServer

    model_id, raw = raw_side(args.model)
    server = LiveServer(["--model", args.model], startup=600)
    try:
        srv = server_side(server.url, model_id)
        print(f"model {model_id}, torch threads {torch.get_num_threads()}, median of {args.reps}")
        print(f"{'workload':<12}{'raw torch s':>14}{'probity s':>12}{'ratio':>8}")
        for name in ("score", "generate", "concurrent"):
            t_srv = timed(srv[name], args.reps)
            t_raw = timed(raw[name], args.reps)
            print(f"{name:<12}{t_raw:>14.3f}{t_srv:>12.3f}{t_srv / t_raw:>8.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
