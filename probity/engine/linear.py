"""A linear layer whose rows come out the same whatever the row count.

oneDNN's fp32 linear with its weight prepacked once (`_linear_pointwise`) reduces each row
the same way for every row count it was tried at (plain `F.linear` switches kernels below 16
rows); a call narrower than the floor calibration measured for its shape is padded up to it.
Calls of up to kernels.MAX_ROWS rows (decode steps) run through probity's own kernel, which
streams the weights once and reduces in oneDNN's own order, where calibration found a k-block
with which it gives oneDNN's bits."""
from __future__ import annotations

import torch

from . import kernels


class Linear:
    """y = x W^T + b. `residual` says how the model calls it (with an add fused into the GEMM
    or not): calibration measures that call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: bool = False):
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float().contiguous()
        self.w = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.b = None if bias is None else bias.detach().float().contiguous()
        self.residual = residual
        self.min_rows = 1   # oneDNN's row floor for this shape (calibration)
        self.kb = None      # the kernel's k-block where it equals oneDNN (calibration), else None
        self.packed = kernels.pack(weight)

    @property
    def shape_key(self) -> tuple[int, int, bool, bool]:
        """What calibration measures once for every linear alike: shape and kind of call."""
        return self.out_features, self.in_features, self.b is not None, self.residual

    def calibrated(self, min_rows: int, kb: int | None) -> None:
        self.min_rows, self.kb = min_rows, kb
        if kb is None:
            self.packed = None   # oneDNN serves every call of this shape; free the copy

    def gemm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """oneDNN's call, as it is (no padding)."""
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.w, self.b, "add")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` when given: that add is done by the GEMM as it writes its
        output (one pass over the rows instead of two). It is the same IEEE add of the same two
        floats, so the bits are those of `residual + self(x)`."""
        n = x.shape[0]
        if self.kb is not None and n <= kernels.MAX_ROWS:
            return kernels.linear(x, self.packed, self.out_features, self.kb, self.b, residual)
        if n >= self.min_rows:
            return self.gemm(x, residual)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(self.min_rows - n, t.shape[1])])
        return self.gemm(pad(x), None if residual is None else pad(residual))[:n]
