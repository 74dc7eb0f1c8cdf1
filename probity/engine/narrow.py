"""probity's own CPU kernels (narrow.c) for the calls the libraries are slow at: linears and
attention GEMMs of a few rows (decode steps), each bit for bit equal to oneDNN's or MKL's, a
decode group's whole attention in two calls, and the per-row norms and rotary embedding.

The linears, in detail:

oneDNN's prepacked fp32 GEMM is what makes the engine's rows batch-invariant, but below ~32
rows it runs far under the machine's memory bound: a decode step must stream every weight
once for a handful of rows, and oneDNN's narrow calls read them at 15-25 GB/s (plus ~20 us of
primitive lookup per call). narrow.c computes the same thing for up to MAX_ROWS rows while
streaming each weight once, and reduces every output in the order oneDNN does on the CPUs
measured so far: one fused multiply-add chain over k from zero, restarted every `kb` values of
k, the block sums then added in order, then the bias, then the residual. Equal order, equal
bits; so a row's numbers do not depend on which kernel ran it.

That order is oneDNN's implementation detail, not its contract, so nothing here trusts it:
`block_for` finds, per shape and kind of call, the `kb` for which this kernel equals a wide
oneDNN call on every probed row count, and a shape for which none does keeps oneDNN for every
call. The kernel is compiled once per source and flags into the user's cache directory (gcc,
AVX2 and FMA; `make setup` builds it); without a compiler or those instructions the engine
runs on oneDNN alone, and says so at startup.

The library links libgomp.so.1, so loaded after torch it resolves to torch's own OpenMP
runtime: one thread pool, sized by torch.set_num_threads.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .cache_dir import cache_dir

MAX_ROWS = 32    # calls of up to this many rows take this kernel (measured faster than oneDNN on every shape up to 32)
PANEL = 16       # outputs per packed panel: the kernel's [ceil(N/16)][K][16] weight layout
SLICE = 64       # attention's key slice: model.KEY_ALIGN, and narrow.c's SLICE (model imports this module)
SCORE_MAX_ROWS = 64   # attention score GEMMs of up to this many rows per item take probity_score (2-3x MKL's speed measured)
VALUE_MAX_ROWS = 4    # ... value GEMMs of up to this many (past it MKL is faster)
HEAD_DIMS = range(8, 257, 8)   # the head dims probity_score handles
BLOCK_CANDIDATES = (None, 1024, 512, 256, 2048, 768, 384, 128)   # None: one chain over all of K
PROBE_ROWS = (1, 2, 3, 5, 6, 7, 12, 13, 31, 32)
SOURCE = Path(__file__).with_name("narrow.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

_lib = None
_why_not: str | None = None


def _cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return all(f in have for f in flags)


def library_path() -> Path:
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir("kernels") / f"narrow-{tag}.so"


def build() -> Path:
    """Compile narrow.c unless this source and these flags were compiled before (atomic: a
    parallel build of the same file cannot leave a torn library)."""
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(["gcc", *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load():
    """The kernel library, or None (then `why_not()` says why)."""
    global _lib, _why_not
    if _lib is not None or _why_not is not None:
        return _lib
    if not _cpu_has("avx2", "fma"):
        _why_not = "this CPU lacks AVX2/FMA"
        return None
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as e:
        _why_not = f"gcc failed: {e.stderr.strip()[-300:]}"
        return None
    except FileNotFoundError as e:
        _why_not = "no gcc to compile it" if e.filename == "gcc" else f"cannot build it: {e}"
        return None
    except OSError as e:   # an unwritable cache directory, a library that will not load
        _why_not = f"cannot build or load it: {e}"
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.probity_linear.argtypes = [p, i, i, p, i, i, i, p, p, i, p, i]
    lib.probity_linear.restype = None
    for f in (lib.probity_score, lib.probity_value):
        f.argtypes = [p, p, p, i, i, i, i]
        f.restype = None
    lib.probity_decode_scores.argtypes = [p, p, p, p, p, i, i, i, i, i, ctypes.c_float, i, ctypes.c_float]
    lib.probity_decode_scores.restype = None
    lib.probity_decode_values.argtypes = [p, p, p, p, p, i, i, i, i, i, i]
    lib.probity_decode_values.restype = None
    lib.probity_rms_norm.argtypes = [p, p, p, i, i, ctypes.c_float]
    lib.probity_rms_norm.restype = None
    lib.probity_rotate.argtypes = [p, i, p, p, p, i, i, i]
    lib.probity_rotate.restype = None
    _lib = lib
    return lib


def why_not() -> str | None:
    return _why_not


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16], the extra outputs zero."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, kb: int,
           bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) (+ residual) for x [M <= MAX_ROWS, K], in oneDNN's order with blocks of kb."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, out_features)
    if residual is not None:
        residual = residual.contiguous()
    _lib.probity_linear(x.data_ptr(), k, m, packed.data_ptr(), out_features, k, kb,
                        None if bias is None else bias.data_ptr(),
                        None if residual is None else residual.data_ptr(), out_features,
                        y.data_ptr(), out_features)
    return y


def score(keys: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """model.score_gemm's result, [KV, items, S, C, 64] from keys [KV, items, S*64, hd] and
    queries [KV, items, C, hd], each score one FMA chain over the head dim in order."""
    KV, items, L, hd = keys.shape
    C = qs.shape[2]
    out = torch.empty(KV, items, L // SLICE, C, SLICE)
    keys, qs = keys.contiguous(), qs.contiguous()
    _lib.probity_score(qs.data_ptr(), keys.data_ptr(), out.data_ptr(), KV * items, L // SLICE, C, hd)
    return out


def value(e: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """model.value_gemm's result, [KV, items, S, C, W] from e [KV, items, S, C, 64] and
    vals [KV, items, S*64, W], each output one FMA chain over the slice's keys in order."""
    KV, items, S, C, _ = e.shape
    W = vals.shape[-1]
    out = torch.empty(KV, items, S, C, W)
    e, vals = e.contiguous(), vals.contiguous()
    _lib.probity_value(e.data_ptr(), vals.data_ptr(), out.data_ptr(), KV * items, S, C, W)
    return out


def decode_attention(q: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                     pos: torch.Tensor, group: int, scale: float, lead: int, floor: float) -> torch.Tensor:
    """model._attend's result for a decode group (one query row per item), [items, H, hd]: the
    same operations in the same order in two calls, with torch's exp between them (its
    vectorized exp is what the general path uses; C would need its exact polynomial)."""
    KV, items, L, hd = keys.shape
    S = L // SLICE
    q, keys, vals = q.contiguous(), keys.contiguous(), vals.contiguous()
    e = torch.empty(KV, items, S, group, SLICE)
    _lib.probity_decode_scores(q.data_ptr(), rows.data_ptr(), keys.data_ptr(), pos.data_ptr(), e.data_ptr(),
                               KV, items, group, L, hd, scale, lead, floor)
    e.exp_()
    part = torch.empty(KV, items, S, group, hd + 1)
    out = torch.empty(items, KV * group, hd)
    _lib.probity_decode_values(e.data_ptr(), vals.data_ptr(), pos.data_ptr(), part.data_ptr(), out.data_ptr(),
                               KV, items, group, L, hd, lead)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] normalized row by row, each row's sum of squares in one fixed order (narrow.c)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    _lib.probity_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """model.rotate's result (the same bits) for x [T, heads, hd] whose heads are contiguous
    within a row, cos / signed_sin [T, 1, hd]."""
    T, heads, hd = x.shape
    out = torch.empty(T, heads, hd)
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    _lib.probity_rotate(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(), T, heads, hd)
    return out


def block_for(packed: torch.Tensor, out_features: int, bias, x: torch.Tensor,
              residual: torch.Tensor | None, wide: torch.Tensor) -> int | None:
    """The k-block with which this kernel gives every probed row count the bits of `wide` (the
    same rows of a wide oneDNN call), or None when no candidate does on this CPU."""
    k = x.shape[1]
    for cand in BLOCK_CANDIDATES:
        kb = k if cand is None else cand
        if cand is not None and cand >= k:
            continue   # the same order as one chain, tried first
        if all(torch.equal(linear(x[:m], packed, out_features, kb, bias,
                                  None if residual is None else residual[:m]), wide[:m])
               for m in PROBE_ROWS):
            return kb
    return None


if __name__ == "__main__":   # `python -m probity.engine.narrow`: build it now (make setup does)
    lib = load()
    print(f"narrow linear kernel: {library_path() if lib else 'not used: ' + str(why_not())}", file=sys.stderr)
    sys.exit(0)
