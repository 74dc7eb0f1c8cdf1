"""One order on every path (issue 37): each kernel that computes a reported number is one
documented sequence of IEEE float operations (docs/engine.md), checked here against an exact
reference of that sequence written independently in Python (every fused multiply-add rounded
once from its exact value, computed with fractions), and run under every PROBITY_ISA this CPU
can run (AVX-512, AVX2 + FMA, the portable build), which must all give the same bits."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from numerics_cases import inputs, outputs
from probity.engine import isa

F = np.float32
HERE = Path(__file__).parent


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy()


def round32(q: Fraction) -> np.float32:
    """q rounded to the nearest float32, ties to even (the double nearest q is within an ulp of
    it; the answer is that float or a neighbour)."""
    f = F(float(q))
    if not np.isfinite(f):
        return f
    best = None
    for c in (np.nextafter(f, F(-np.inf)), f, np.nextafter(f, F(np.inf))):
        if not np.isfinite(c):
            continue
        d = abs(Fraction(float(c)) - q)
        even = int(np.array(c).view(np.uint32)) & 1 == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, c)
    return best[1]


def fma(a, b, c) -> np.float32:
    """a * b + c rounded once."""
    a, b, c = F(a), F(b), F(c)
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if exact == 0:   # IEEE: -0 only when the product and c are both -0
        return F(-0.0) if (np.signbit(a) != np.signbit(b)) and np.signbit(c) and (a == 0 or b == 0) else F(0.0)
    return round32(exact)


def chain(xs, ws, blocks: int | None = None) -> np.float32:
    """An FMA chain from zero over the pairs in order, restarted every `blocks` values, the block
    sums added in order."""
    total = None
    n = len(xs)
    step = blocks or n
    for k0 in range(0, n, step):
        a = F(0.0)
        for x, w in zip(xs[k0:k0 + step], ws[k0:k0 + step]):
            a = fma(x, w, a)
        total = a if total is None else F(total + a)
    return total


def ref_exp(x: np.float32) -> np.float32:
    """numerics.c's exp, step by step."""
    x = F(x)
    c = x if x > F(-88) else F(-88)
    c = c if c < F(88) else F(88)
    magic = F(12582912.0)
    t = fma(c, F(1.44269504088896341), magic)
    n = F(t - magic)
    ni = int(np.array(t).view(np.int32)) - int(np.array(magic).view(np.int32))
    r = fma(n, -F(0.693359375), c)
    r = fma(n, -F(-2.12194440e-4), r)
    p = F(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fma(p, r, F(coef))
    p = fma(p, F(r * r), r)
    p = F(p + F(1.0))
    y = F(p * np.array((ni + 127) << 23, dtype=np.uint32).view(np.float32))
    return F(np.inf) if x > F(88) else y


@pytest.fixture(scope="module")
def native():
    return inputs(), outputs()


@pytest.fixture(scope="module")
def per_path():
    """Every kernel's outputs under each path this CPU runs, each computed in its own process."""
    out = {}
    for path in isa.runnable(isa.cpu_flags()):
        dump = Path(os.environ.get("TMPDIR", "/tmp")) / f"probity-numerics-{os.getpid()}-{path}.pt"
        r = subprocess.run([sys.executable, str(HERE / "numerics_cases.py"), str(dump)], cwd=ROOT,
                           env={**os.environ, "PROBITY_ISA": path, "PYTHONPATH": f"{ROOT}:{HERE}"},
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out[path] = torch.load(dump)
        dump.unlink()
    return out


def test_every_path_gives_the_same_bits(native, per_path):
    _, here = native
    builds = {p: o["build"] for p, o in per_path.items()}
    assert builds.get("avx2", "vector build, AVX2") == "vector build, AVX2" and builds["generic"] == "portable build"
    if "avx512" in builds:
        assert builds["avx512"] == "vector build, AVX-512"
    for path, theirs in per_path.items():
        for name, t in here.items():
            assert np.array_equal(bits(theirs[name]), bits(t)), f"{name} on {path} differs from this process's"


def test_linear_is_one_blocked_fma_chain_per_output_at_every_row_count(native):
    i, o = native
    x, w, b, res = (i[k].numpy() for k in ("x", "w", "b", "res"))
    wide = o["linear40"]
    assert np.array_equal(bits(o["linear1"]), bits(wide[:1])) and np.array_equal(bits(o["linear7"]), bits(wide[:7]))
    for m in (0, 6, 39):
        for n in range(18):
            want = F(F(chain(x[m], w[n], 512) + b[n]) + res[m, n])
            assert wide[m, n].item() == want and np.signbit(wide[m, n].item()) == np.signbit(want), (m, n)


def test_attention_gemms_are_fma_chains_in_order(native):
    i, o = native
    q, keys, e, vals = (i[k].numpy() for k in ("q", "keys", "e", "vals"))
    s = o["score"].numpy()          # [KV, items, S, C, 64]
    for c in (0, 4):
        for j in range(128):
            assert s[0, 0, j // 64, c, j % 64] == chain(q[0, 0, c], keys[0, 0, j]), (c, j)
    v = o["value"].numpy()          # [KV, items, S, C, W]
    for c in (0, 4):
        for col in range(65):
            assert v[0, 0, 1, c, col] == chain(e[0, 0, 1, c], vals[0, 0, 64:, col]), (c, col)


def test_exp_is_the_documented_sequence_and_within_two_ulps(native):
    i, o = native
    got = o["exp"].numpy()
    for x, y in zip(i["exp_in"].numpy(), got):
        want = ref_exp(x)
        assert np.array(y).view(np.uint32) == np.array(want).view(np.uint32), (x, y, want)
        if -87 <= x <= 88:
            assert abs(float(y) - math.exp(float(x))) <= 2 * float(np.spacing(F(math.exp(float(x))))), x


def test_log_softmax_folds_sixteen_partial_sums_in_a_fixed_order(native):
    i, o = native
    x = i["logits"].numpy()
    for r in range(x.shape[0]):
        m = x[r].max()
        s = [F(0.0)] * 16
        for k, v in enumerate(x[r]):
            s[k % 16] = F(s[k % 16] + ref_exp(F(v - m)))
        for width in (8, 4, 2, 1):
            for j in range(width):
                s[j] = F(s[j] + s[j + width])
        L = F(math.log(float(s[0])))
        want = (x[r] - m).astype(F) - L
        assert np.array_equal(o["log_softmax"][r].numpy().view(np.uint32), want.view(np.uint32)), r
        ref = torch.log_softmax(torch.from_numpy(x[r]).double(), -1).numpy()
        assert np.abs(o["log_softmax"][r].numpy() - ref).max() < 1e-5


def test_silu_mul_and_rms_norm_are_the_documented_sequences(native):
    i, o = native
    gu = i["gu"].numpy()
    I = gu.shape[1] // 2
    for t in range(gu.shape[0]):
        for k in range(I):
            g, u = gu[t, k], gu[t, I + k]
            want = F(F(g / F(F(1.0) + ref_exp(F(F(0.0) - g)))) * u)
            assert o["silu_mul"][t, k].item() == want, (t, k)
    x, w = i["norm_x"].numpy(), i["norm_w"].numpy()
    D = x.shape[1]
    for t in range(x.shape[0]):
        p = [F(0.0)] * 32
        for k in range(D // 32 * 32):
            p[k % 32] = fma(x[t, k], x[t, k], p[k % 32])
        a = [F(F(p[l] + p[8 + l]) + F(p[16 + l] + p[24 + l])) for l in range(8)]
        h = [F(a[l] + a[l + 4]) for l in range(4)]
        total = F(F(h[0] + h[2]) + F(h[1] + h[3]))
        for k in range(D // 32 * 32, D):
            total = fma(x[t, k], x[t, k], total)
        r = F(F(1.0) / F(np.sqrt(F(F(total / F(D)) + F(1e-5)))))
        want = ((x[t] * r).astype(F) * w).astype(F)
        assert np.array_equal(o["rms_norm"][t].numpy(), want), t


def test_cos_and_sin_are_the_correctly_rounded_floats(native):
    i, o = native
    a = i["angles"].numpy().tolist()
    assert np.array_equal(o["cos"].numpy(), np.array([math.cos(v) for v in a], dtype=F))
    assert np.array_equal(o["sin"].numpy(), np.array([math.sin(v) for v in a], dtype=F))


def test_an_engine_without_its_kernels_does_not_start(tiny_model_dir, tmp_path):
    """No gcc to build the kernels (a fresh cache, gcc off the PATH): the engine names why and
    stops; it never serves numbers computed another way."""
    from conftest import tiny_args
    env = {**os.environ, "PROBITY_CACHE_DIR": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    r = subprocess.run([sys.executable, "-m", "probity", "serve", *tiny_args(tiny_model_dir)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "kernels could not be built or loaded here: no gcc to compile it" in r.stderr, \
        r.stderr[-2000:]
