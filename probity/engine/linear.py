"""A linear layer whose rows come out the same whatever the row count.

oneDNN's fp32 linear with its weight prepacked once (`_linear_pointwise`) reduces each row
the same way for every row count it was tried at (plain `F.linear` switches kernels below 16
rows); a call narrower than the floor calibration measured for its shape is padded up to it.
Calls of up to kernels.MAX_ROWS rows (decode steps) run through probity's own kernel, which
streams the weights once and reduces in oneDNN's own order, where calibration found a k-block
with which it gives oneDNN's bits.

A weight kept as stored (stored.py: bf16, f16, GGUF blocks) is never held in float32: the kernel
expands it panel by panel as it goes — for calls of every row count where the CPU has AVX-512
(stored.c's wide kernel; calibration checks it at a wide call too), else up to MAX_ROWS rows,
wider calls then expanding the layer into a scratch buffer the size of the largest such layer,
which oneDNN reads as a plain float32 weight (the same bits as the prepacked one for every
call of two rows or more, measured; calibration checks the calls it serves)."""
from __future__ import annotations

import torch

from . import kernels
from .stored import StoredWeight

_scratch = torch.empty(0)


def _expanded(w: StoredWeight) -> torch.Tensor:
    """The float32 weight in the shared scratch buffer (valid until the next call)."""
    global _scratch
    n, k = w.shape
    if _scratch.numel() < n * k:
        _scratch = torch.empty(n * k)
    out = _scratch[: n * k].view(n, k)
    kernels.lib().probity_expand(w.code, w.packed.data_ptr(), n, k, out.data_ptr())
    return out


def scratch_bytes() -> int:
    return _scratch.numel() * 4


def release_scratch(linears) -> None:
    """Free the scratch buffer when no stored linear among `linears` will expand into it again
    (the kernel serves all their calls); calibration's oneDNN reference calls filled it."""
    global _scratch
    if all(lin.stored is None or (lin.wide and lin.kb is not None) for lin in linears):
        _scratch = torch.empty(0)


class Linear:
    """y = x W^T + b. `residual` says how the model calls it (with an add fused into the GEMM
    or not): calibration measures that call. `weight`: a float tensor (kept as float32,
    prepacked) or a StoredWeight (kept as it is)."""

    def __init__(self, weight: torch.Tensor | StoredWeight, bias: torch.Tensor | None = None, residual: bool = False):
        self.b = None if bias is None else bias.detach().float().contiguous()
        self.residual = residual
        self.min_rows = 1   # oneDNN's row floor for this shape (calibration)
        self.kb = None      # the kernel's k-block where it equals oneDNN (calibration), else None
        if isinstance(weight, StoredWeight):
            self.out_features, self.in_features = weight.shape
            self.stored: StoredWeight | None = weight
            self.w = None
            self.packed = None
        else:
            self.out_features, self.in_features = weight.shape
            weight = weight.detach().float().contiguous()
            self.stored = None
            self.w = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            self.packed = kernels.pack(weight)

    @property
    def shape_key(self) -> tuple:
        """What calibration measures once for every linear alike: shape, kind of call, and
        whether oneDNN reads a prepacked or a plain (expanded) weight."""
        return self.out_features, self.in_features, self.b is not None, self.residual, self.stored is not None

    @property
    def wide(self) -> bool:
        """Whether probity's kernel takes this linear's calls of every row count (a stored
        weight where the wide AVX-512 kernel is built), not only up to kernels.MAX_ROWS."""
        return self.stored is not None and kernels.stored_wide()

    @property
    def has_kernel(self) -> bool:
        return kernels.lib() is not None and (self.stored is not None or self.packed is not None)

    def calibrated(self, min_rows: int, kb: int | None) -> None:
        self.min_rows, self.kb = min_rows, kb
        if kb is None:
            self.packed = None   # oneDNN serves every call of this shape; free the copy

    def gemm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """oneDNN's call, as it is (no padding)."""
        w = self.w if self.stored is None else _expanded(self.stored)
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, w, self.b, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, self.b, "add")

    def narrow(self, x: torch.Tensor, kb: int, residual: torch.Tensor | None = None) -> torch.Tensor:
        """probity's kernel with k-block kb (x of at most kernels.MAX_ROWS rows)."""
        if self.stored is not None:
            return kernels.linear_stored(x, self.stored, kb, self.b, residual)
        return kernels.linear(x, self.packed, self.out_features, kb, self.b, residual)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` when given: that add is done by the GEMM as it writes its
        output (one pass over the rows instead of two). It is the same IEEE add of the same two
        floats, so the bits are those of `residual + self(x)`."""
        n = x.shape[0]
        if self.kb is not None and (n <= kernels.MAX_ROWS or self.wide):
            return self.narrow(x, self.kb, residual)
        if n >= self.min_rows:
            return self.gemm(x, residual)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(self.min_rows - n, t.shape[1])])
        return self.gemm(pad(x), None if residual is None else pad(residual))[:n]

    def weight_bytes(self) -> dict[str, int]:
        """Bytes held for the weight, by form (memory accounting)."""
        def nb(t):
            if t is None:
                return 0
            try:
                return t.untyped_storage().nbytes()
            except NotImplementedError:   # oneDNN's packed weight is opaque: its logical size
                return t.numel() * t.element_size()
        return {"weights_onednn": nb(self.w) + nb(self.b), "weights_kernels": nb(self.packed),
                "weights_stored": 0 if self.stored is None else self.stored.nbytes()}
