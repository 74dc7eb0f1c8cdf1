"""This machine's limits, to say how close a figure is to them: memory read bandwidth (one and
all threads, over a buffer far larger than any cache), the float32 GEMM peak (probity's own
kernel and torch.mm), and the default model's per-token cost (bytes of weights as stored,
FLOPs of its linears), so that a tokens/s figure reads as GB/s and GFLOP/s.

    .venv/bin/python bench/limits.py [--isa avx2]    # PROBITY_ISA for probity's kernel

Run it on a quiet machine (no benchmark, no test beside it): it reports the best of several
tries, which is the machine's figure, not a typical one."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def best(f, tries: int = 5) -> float:
    """The shortest of `tries` timings of f() (the first call's warm-up discarded)."""
    f()
    out = []
    for _ in range(tries):
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return min(out)


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default=None, help="PROBITY_ISA for probity's kernel (avx512, avx2, generic)")
    ap.add_argument("--mib", type=int, default=1024, help="the bandwidth buffer (MiB)")
    args = ap.parse_args()
    if args.isa:
        os.environ["PROBITY_ISA"] = args.isa
    import torch

    from probity.engine import kernels
    from probity.engine.loader import default_model_path

    threads = os.cpu_count()
    print(f"{cpu_name()}, {threads} cores, torch {torch.__version__}, probity kernels: {kernels.describe()}")
    buf = torch.ones(args.mib * 2 ** 20 // 4)
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        s = best(lambda: buf.sum())
        print(f"memory read, {t} thread(s), {args.mib} MiB: {buf.numel() * 4 / s / 1e9:.1f} GB/s")
    torch.set_num_threads(threads)
    m, k, n = 512, 4096, 4096
    x, w = torch.randn(m, k), torch.randn(n, k)
    packed = kernels.pack(w)
    flop = 2 * m * k * n
    s = best(lambda: kernels.linear(x, packed, n, kernels.KB))
    print(f"float32 GEMM {m} x {k} x {n}, probity's kernel ({threads} threads): {flop / s / 1e9:.0f} GFLOP/s")
    s = best(lambda: torch.mm(x, w.t()))
    print(f"float32 GEMM {m} x {k} x {n}, torch.mm ({threads} threads): {flop / s / 1e9:.0f} GFLOP/s")
    for rows in (1, 8, 32):
        xs = torch.randn(rows, k)
        s = best(lambda: kernels.linear(xs, packed, n, kernels.KB), tries=20)
        print(f"  {rows:>2} rows x {k} x {n} (64 MiB of float32 weights): {2 * rows * k * n / s / 1e9:.1f} GFLOP/s, "
              f"{n * k * 4 / s / 1e9:.1f} GB/s of weights")
    stored, values, macs = per_token(default_model_path())
    print(f"default model per token: {stored / 1e6:.1f} MB of weights as stored ({values * 4 / 1e6:.1f} MB in "
          f"float32), {2 * macs / 1e9:.3f} GFLOP in its linears (the head included)")


def per_token(gguf_path) -> tuple[int, int, int]:
    """A GGUF's bytes as stored, its values, and the multiply-adds a token costs in its matrices:
    every 2-d tensor is a linear once, the token embedding too where it is the (tied) head."""
    from gguf import GGUFReader
    r = GGUFReader(str(gguf_path))
    names = {t.name for t in r.tensors}
    stored = sum(int(t.n_bytes) for t in r.tensors)
    values = sum(int(t.n_elements) for t in r.tensors)
    macs = sum(int(t.n_elements) for t in r.tensors if len(t.shape) == 2
               and (t.name != "token_embd.weight" or "output.weight" not in names))
    return stored, values, macs


if __name__ == "__main__":
    main()
