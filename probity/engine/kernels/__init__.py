"""probity's own CPU kernels (built by build.py: the vector build of kernels.c, stored.c and
numerics.c, or the portable build of portable.c and numerics.c), as named, checked ops.

They define the engine's numbers: every operation whose result reaches a reported number
(linears at every row count, attention's two sliced GEMMs and its exp, the norms, the rotary
embedding and its cos/sin, SiLU, the log-softmax) is one documented sequence of IEEE float
operations, and every build and instruction-set path computes exactly that sequence, so the
bits do not depend on the CPU, its vector width, the thread count or the row count
(docs/engine.md, "One order on every path"; tests/test_numerics.py checks each against an
exact reference of the order). No library's reduction order is used for a number.

Without a library (no gcc, an unwritable cache: `why_not()`) the engine does not start: the
numbers are these kernels' (runner.py names the reason).
"""
from __future__ import annotations

import torch

from . import build

KB = 512               # a linear's FMA chains restart every KB values of k (the block sums then added in order)
PANEL = 16             # outputs per packed weight panel: the kernel's [ceil(N/16)][K][16] layout
SLICE = 64             # attention's key slice (attention.KEY_ALIGN)
HEAD_DIM_MAX = 256     # the largest head dim the attention kernels hold
GROUP_MAX = 16         # the largest query-head group decode_attention holds
HEAD_DIMS = range(8, HEAD_DIM_MAX + 1, 8)
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


def portable() -> bool:
    """Whether the portable build is loaded (PROBITY_ISA=generic, or a CPU without AVX2/FMA)."""
    return lib() is not None and _lib.portable


def stores() -> bool:
    """Whether weights can be kept as stored (bf16, f16, GGUF blocks): the vector build only."""
    return lib() is not None and not _lib.portable


def fused_decode() -> bool:
    """Whether a decode group's attention runs in one kernel (the vector build only; the same
    operations as the general path, so the same bits)."""
    return lib() is not None and not _lib.portable


def describe() -> str:
    """Which code computes the numbers here, for the log."""
    if lib() is None:
        return f"none ({why_not()})"
    return "portable build" if _lib.portable else ("vector build, AVX-512" if _lib.probity_cpu_avx512()
                                                  else "vector build, AVX2")


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
    """x W^T (+ bias) (+ residual) for x [M, K], any M: one FMA chain over k from zero,
    restarted every kb values, the block sums added in order, then the bias, then the residual."""
    x, residual = _linear_args(x, residual, out_features)
    m, k = x.shape
    if packed.shape[1] != k or packed.shape[0] * PANEL < out_features:
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


def linear_stored(x: torch.Tensor, w, kb: int, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` for a weight kept as stored (stored.StoredWeight): each panel expanded in the
    kernel to the reference de-quantization's float32 values, then the same FMA chains, any
    row count."""
    n = w.shape[0]
    x, residual = _linear_args(x, residual, n)
    m, k = x.shape
    if w.shape[1] != k:
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
    depend on how far the keys are padded. Each score is one FMA chain over the head dim in
    order, from zero."""
    KV, items, L, hd = keys.shape
    C = qs.shape[2]
    if hd <= HEAD_DIM_MAX:
        out = torch.empty(KV, items, L // SLICE, C, SLICE)
        keys, qs = keys.contiguous(), qs.contiguous()
        lib().probity_score(qs.data_ptr(), keys.data_ptr(), out.data_ptr(), KV * items, L // SLICE, C, hd)
        return out
    # a head dim past the kernel's buffer: MKL's GEMM (its order may follow the CPU; docs/engine.md)
    return torch.matmul(qs[:, :, None], keys.view(KV, items, L // SLICE, SLICE, hd).transpose(-1, -2))


def value_gemm(e: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """The value GEMM in the same slices: e [KV, items, S, C, SLICE] (softmax numerators) and
    vals [KV, items, L, W] give the slices' partial results [KV, items, S, C, W], each one FMA
    chain over the slice's keys in order, from zero."""
    KV, items, S, C, _ = e.shape
    W = vals.shape[-1]
    out = torch.empty(KV, items, S, C, W)
    e, vals = e.contiguous(), vals.contiguous()
    lib().probity_value(e.data_ptr(), vals.data_ptr(), out.data_ptr(), KV * items, S, C, W)
    return out


def decode_attention(q: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                     pos: torch.Tensor, group: int, scale: float, lead: int, floor: float) -> torch.Tensor:
    """attention.attend's result for a decode group (one query row per item), [items, H, hd]:
    the same operations in the same order in two calls, with exp_ between them."""
    KV, items, L, hd = keys.shape
    if hd not in HEAD_DIMS or group > GROUP_MAX or L % SLICE or vals.shape[-1] != hd + 1:
        raise ValueError(f"decode_attention: head dim {hd}, group {group}, {L} keys, values {tuple(vals.shape)}")
    S = L // SLICE
    q, keys, vals = q.contiguous(), keys.contiguous(), vals.contiguous()
    rows, pos = rows.contiguous(), pos.contiguous()
    e = torch.empty(KV, items, S, group, SLICE)
    _lib.probity_decode_scores(q.data_ptr(), rows.data_ptr(), keys.data_ptr(), pos.data_ptr(), e.data_ptr(),
                               KV, items, group, L, hd, scale, lead, floor)
    exp_(e)
    part = torch.empty(KV, items, S, group, hd + 1)
    out = torch.empty(items, KV * group, hd)
    _lib.probity_decode_values(e.data_ptr(), vals.data_ptr(), pos.data_ptr(), part.data_ptr(), out.data_ptr(),
                               KV, items, group, L, hd, lead)
    return out


def kv_store(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kdst: torch.Tensor, vdst: torch.Tensor,
             rows: torch.Tensor | None = None) -> None:
    """Keys and values k, v [T, KV, hd] (rows `rows` of them where given) into slots `slots`
    of kdst [KV, X, hd] and vdst [KV, X, hd+1] (its first hd columns): plain copies."""
    T, KV, hd = k.shape
    n = T if rows is None else rows.numel()
    k = k if k.stride(2) == 1 and k.stride(1) == hd else k.contiguous()   # heads hd apart, as the kernel reads
    v = v if v.stride(2) == 1 and v.stride(1) == hd else v.contiguous()
    if (v.shape != k.shape or k.dtype != torch.float32 or v.dtype != torch.float32 or slots.numel() != n
            or kdst.shape[0] != KV or kdst.shape[2] != hd or vdst.shape[2] != hd + 1
            or not kdst.is_contiguous() or not vdst.is_contiguous()):
        raise ValueError(f"kv_store: keys {tuple(k.shape)}, values {tuple(v.shape)}, {slots.numel()} slots, "
                         f"into {tuple(kdst.shape)} / {tuple(vdst.shape)}")
    slots = slots.to(torch.int64).contiguous()
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
    lib().probity_kv_store(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                           None if rows is None else rows.data_ptr(), n, KV, hd, slots.data_ptr(),
                           kdst.data_ptr(), kdst.stride(0), vdst.data_ptr(), vdst.stride(0))


# ---------------------------------------------------------------- per-row ops

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dim, any leading dims (the per-head q/k norms
    too): each row's sum of squares in one fixed order (kernels.c: 32 partial FMA chains folded
    in a fixed tree), then (x * (1 / sqrt(sum / D + eps))) * w."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    y = torch.empty_like(x)
    lib().probity_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y.view(shape)


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


# ---------------------------------------------------------------- elementwise and row functions

def exp_(t: torch.Tensor) -> torch.Tensor:
    """t = exp(t) in place (numerics.c's exp), t contiguous float32."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"exp_: expected a contiguous float32 tensor, got {t.dtype}")
    lib().probity_exp(t.data_ptr(), t.data_ptr(), t.numel())
    return t


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gu [T, 2I] = [gate | up]: (g / (1 + exp(-g))) * u per element."""
    T, I2 = gu.shape
    I = I2 // 2
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    out = torch.empty(T, I)
    lib().probity_silu_mul(gu.data_ptr(), gu.stride(0), out.data_ptr(), T, I)
    return out


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of x [R, V] float32: (x - max) - log(sum exp(x - max)), the
    sum in 16 partial sums folded in a fixed order (numerics.c)."""
    x = x.float()
    if x.dim() == 1:
        return log_softmax(x[None])[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape)
    lib().probity_log_softmax(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0], x.shape[1])
    return y


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of float32 angles, each computed in double by numerics.c's own series and
    rounded once (torch's vectorized cos/sin differ between instruction sets)."""
    a = angles.float().contiguous()
    c, s = torch.empty(a.shape), torch.empty(a.shape)
    lib().probity_cos_sin(a.data_ptr(), c.data_ptr(), s.data_ptr(), a.numel())
    return c, s


def switch_off(reason: str) -> None:
    """Run every op on its torch path from now on (tests: a machine without the kernel)."""
    global _lib, _why_not, _loaded
    _lib, _why_not, _loaded = None, reason, True
