"""probity's own CPU kernels (kernels.c, built by build.py), as named, checked ops.

They serve the calls the libraries are slow at — linears and attention GEMMs of a few rows
(decode steps), a decode group's whole attention, the per-row norms and rotary embedding —
and each gives the bits of the path it replaces: oneDNN's fp32 linear, MKL's sliced
attention GEMMs, attention's own general path, the rotary's torch ops. That equality is an
implementation detail of those libraries, not their contract, so the engine trusts none of
it: calibration.py checks each use at startup on this CPU and keeps the library path where
a kernel does not match. The RMS norm is the exception: it defines its own fixed order per
row (not torch's), and serves every path alike.

Each op that has a torch path here (`score_gemm`, `value_gemm`, `rms_norm`, `rotate`) picks
it whenever the kernel does not apply; `linear` and `decode_attention` are called only where
calibration said so. Without gcc, AVX2 or FMA (`why_not()`), every op runs its torch path.
"""
from __future__ import annotations

import torch

from . import build

MAX_ROWS = 32          # linear calls of up to this many rows take the kernel (faster than oneDNN up to 32, measured)
PANEL = 16             # outputs per packed weight panel: the kernel's [ceil(N/16)][K][16] layout
SLICE = 64             # attention's key slice (attention.KEY_ALIGN)
HEAD_DIM_MAX = 256     # the largest head dim the attention kernels hold
GROUP_MAX = 16         # the largest query-head group decode_attention holds
HEAD_DIMS = range(8, HEAD_DIM_MAX + 1, 8)
SCORE_MAX_ROWS = 64    # score GEMMs of up to this many rows per item take the kernel (2-3x MKL's speed measured)
VALUE_MAX_ROWS = 4     # value GEMMs of up to this many (past it MKL is faster)
CONSTANTS = {"PANEL": PANEL, "SLICE": SLICE, "HD_MAX": HEAD_DIM_MAX, "G_MAX": GROUP_MAX}

_lib = None
_why_not: str | None = None
_loaded = False


def lib():
    """The kernel library, or None (then `why_not()` says why). Built on first use."""
    global _lib, _why_not, _loaded
    if not _loaded:
        _lib, _why_not = build.load(CONSTANTS)
        _loaded = True
    return _lib


def why_not() -> str | None:
    lib()
    return _why_not


def library_path():
    return build.library_path(CONSTANTS)


def _f32(t: torch.Tensor, dims: int, name: str) -> None:
    if t.dtype != torch.float32 or t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-d float32 tensor, got {t.dim()}-d {t.dtype}")


# ---------------------------------------------------------------- linears

def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """[N, K] -> [ceil(N/16), K, 16], the extra outputs zero; None where there is no kernel."""
    if lib() is None:
        return None
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, kb: int,
           bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) (+ residual) for x [M <= MAX_ROWS, K]: one FMA chain over k from zero,
    restarted every kb values, the block sums added in order, then the bias, then the residual."""
    x, residual = _linear_args(x, residual, out_features)
    m, k = x.shape
    if m > MAX_ROWS or packed.shape[1] != k or packed.shape[0] * PANEL < out_features:
        raise ValueError(f"linear: {m} rows of {k} against packed {tuple(packed.shape)} for {out_features} outputs")
    y = torch.empty(m, out_features)
    _lib.probity_linear(x.data_ptr(), k, m, packed.data_ptr(), out_features, k, kb,
                        None if bias is None else bias.data_ptr(),
                        None if residual is None else residual.data_ptr(), out_features,
                        y.data_ptr(), out_features)
    return y


def _linear_args(x: torch.Tensor, residual: torch.Tensor | None, n: int):
    """x and the residual, contiguous and checked, for a linear of n outputs."""
    x = x.contiguous()
    _f32(x, 2, "linear x")
    if residual is not None:
        residual = residual.contiguous()
        if residual.shape != (x.shape[0], n):
            raise ValueError(f"linear: residual {tuple(residual.shape)} for output ({x.shape[0]}, {n})")
    return x, residual


def stored_wide() -> bool:
    """Whether linear_stored takes calls of any row count here (its AVX-512 wide kernel), not
    only up to MAX_ROWS."""
    return lib() is not None and bool(_lib.probity_stored_wide())


def linear_stored(x: torch.Tensor, w, kb: int, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` for a weight kept as stored (stored.StoredWeight): each panel expanded in the
    kernel to the reference de-quantization's float32 values, then the same FMA chains. Any
    row count where stored_wide(), else up to MAX_ROWS."""
    n = w.shape[0]
    x, residual = _linear_args(x, residual, n)
    m, k = x.shape
    if (m > MAX_ROWS and not stored_wide()) or w.shape[1] != k:
        raise ValueError(f"linear: {m} rows of {k} against a stored weight {w.shape}")
    y = torch.empty(m, n)
    _lib.probity_linear_stored(w.code, x.data_ptr(), k, m, w.packed.data_ptr(), n, k, kb,
                               None if bias is None else bias.data_ptr(),
                               None if residual is None else residual.data_ptr(), n, y.data_ptr(), n)
    return y


# ---------------------------------------------------------------- attention's GEMMs

def score_gemm(keys: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Attention scores in slices of SLICE keys, [KV, items, S, C, SLICE], from keys
    [KV, items, L, hd] (L = S * SLICE) and queries [KV, items, C, hd]: one small GEMM per
    slice, the queries as its rows and the slice's keys (read transposed in place) as its
    columns. Every call has the same shape whatever the key length, so a score's bits cannot
    depend on how far the keys are padded. The kernel computes each score as one FMA chain
    over the head dim in order (MKL's order for these calls, checked at startup)."""
    KV, items, L, hd = keys.shape
    C = qs.shape[2]
    if C <= SCORE_MAX_ROWS and hd in HEAD_DIMS and lib() is not None:
        out = torch.empty(KV, items, L // SLICE, C, SLICE)
        keys, qs = keys.contiguous(), qs.contiguous()
        _lib.probity_score(qs.data_ptr(), keys.data_ptr(), out.data_ptr(), KV * items, L // SLICE, C, hd)
        return out
    return torch.matmul(qs[:, :, None], keys.view(KV, items, L // SLICE, SLICE, hd).transpose(-1, -2))


def value_gemm(e: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """The value GEMM in the same slices: e [KV, items, S, C, SLICE] (softmax numerators) and
    vals [KV, items, L, W] give the slices' partial results [KV, items, S, C, W]."""
    KV, items, S, C, _ = e.shape
    W = vals.shape[-1]
    if C <= VALUE_MAX_ROWS and lib() is not None:
        out = torch.empty(KV, items, S, C, W)
        e, vals = e.contiguous(), vals.contiguous()
        _lib.probity_value(e.data_ptr(), vals.data_ptr(), out.data_ptr(), KV * items, S, C, W)
        return out
    return torch.matmul(e, vals.view(KV, items, S, SLICE, W))


def decode_attention(q: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                     pos: torch.Tensor, group: int, scale: float, lead: int, floor: float) -> torch.Tensor:
    """attention.attend's result for a decode group (one query row per item), [items, H, hd]:
    the same operations in the same order in two calls, with torch's exp between them (its
    vectorized exp is what the general path uses; C would need its exact polynomial)."""
    KV, items, L, hd = keys.shape
    if hd not in HEAD_DIMS or group > GROUP_MAX or L % SLICE or vals.shape[-1] != hd + 1:
        raise ValueError(f"decode_attention: head dim {hd}, group {group}, {L} keys, values {tuple(vals.shape)}")
    S = L // SLICE
    q, keys, vals = q.contiguous(), keys.contiguous(), vals.contiguous()
    rows, pos = rows.contiguous(), pos.contiguous()
    e = torch.empty(KV, items, S, group, SLICE)
    _lib.probity_decode_scores(q.data_ptr(), rows.data_ptr(), keys.data_ptr(), pos.data_ptr(), e.data_ptr(),
                               KV, items, group, L, hd, scale, lead, floor)
    e.exp_()
    part = torch.empty(KV, items, S, group, hd + 1)
    out = torch.empty(items, KV * group, hd)
    _lib.probity_decode_values(e.data_ptr(), vals.data_ptr(), pos.data_ptr(), part.data_ptr(), out.data_ptr(),
                               KV, items, group, L, hd, lead)
    return out


# ---------------------------------------------------------------- per-row ops

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dim. A [rows, hidden] input runs in the
    kernel, each row's sum of squares in one fixed order (4x faster than the torch ops on one
    row, and a row's bits cannot depend on the others); otherwise (the per-head q/k norms, or
    no kernel) F.rms_norm's ops in its order, the steps after the first in place: a fresh
    buffer is memory the CPU must fetch before it writes it, and right after a GEMM has
    streamed its weights through the caches that fetch costs more than the arithmetic."""
    if x.dim() == 2 and lib() is not None:
        x = x.contiguous()
        y = torch.empty_like(x)
        _lib.probity_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        return y
    r = torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps))
    return torch.mul(x, r).mul_(w)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, x * cos + rotate_half(x) * sin, with rotate_half's negation carried by
    `signed_sin` (its first half negated): x2 * -s is exactly -(x2 * s), so the bits are those
    of the textbook form, one pass over the rows fewer. x [T, heads, hd], cos/sin [T, 1, hd].
    The kernel does the same ops per element in one call (the same bits)."""
    T, heads, hd = x.shape
    if x.stride(2) == 1 and x.stride(1) == hd and hd % 2 == 0 and lib() is not None:
        out = torch.empty(T, heads, hd)
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        _lib.probity_rotate(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(),
                            T, heads, hd)
        return out
    half = hd // 2
    rot = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(signed_sin)
    return torch.mul(x, cos).add_(rot)


def switch_off(reason: str) -> None:
    """Run every op on its torch path from now on (tests: a machine without the kernel)."""
    global _lib, _why_not, _loaded
    _lib, _why_not, _loaded = None, reason, True
