"""A linear layer whose rows come out the same whatever the row count, the batch, the CPU or
its instruction set: probity's kernel computes every call, each output one FMA chain over k
from zero, restarted every kernels.KB values, the block sums added in order, then the bias,
then the residual (docs/engine.md, "One order on every path").

A float32 weight is kept once, packed in the kernel's [ceil(N/16)][K][16] panels. A weight kept
as stored (stored.py: bf16, f16, GGUF blocks) is never held in float32: the kernel expands it
panel by panel as it goes."""
from __future__ import annotations

import torch

from . import kernels
from .stored import StoredWeight


class Linear:
    """y = x W^T + b. `residual`: the model adds a residual to this layer's output, which the
    kernel does as it writes it. `weight`: a float tensor (kept as float32, packed) or a
    StoredWeight (kept as it is)."""

    def __init__(self, weight: torch.Tensor | StoredWeight, bias: torch.Tensor | None = None, residual: bool = False):
        self.b = None if bias is None else bias.detach().float().contiguous()
        self.residual = residual
        self.out_features, self.in_features = weight.shape
        self.stored: StoredWeight | None = None
        self.packed = None
        if isinstance(weight, StoredWeight):
            self.stored = weight
        else:
            self.packed = kernels.pack(weight.detach().float().contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` when given: that add is done by the kernel as it writes
        its output (one pass over the rows instead of two). It is the same IEEE add of the same
        two floats, so the bits are those of `residual + self(x)`."""
        if self.stored is not None:
            return kernels.linear_stored(x, self.stored, kernels.KB, self.b, residual)
        return kernels.linear(x, self.packed, self.out_features, kernels.KB, self.b, residual)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes held for the weight, by form (memory accounting)."""
        def nb(t):
            return 0 if t is None else t.untyped_storage().nbytes()
        return {"weights_kernels": nb(self.packed) + nb(self.b),
                "weights_stored": 0 if self.stored is None else self.stored.nbytes()}
