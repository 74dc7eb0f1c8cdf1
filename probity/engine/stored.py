"""Weights as stored: a linear layer's weight kept in memory as the checkpoint holds it — bf16
or f16, or GGUF-quantized blocks — repacked for the kernels (kernels/stored.c) and expanded, at
the moment it is used, to the very float32 values the reference de-quantization gives
(gguf-py's de-quantizers; the exact 16-bit upcast). The numbers are then bit-identical to
serving the float32 conversion.

`pack` reads the checkpoint's raw blocks (integers and float16 scales only: no float arithmetic
happens here) and lays them out 16 rows side by side per group of 32 values, the layout
stored.c decodes with one vector op per position of 16 rows."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import kernels

PANEL = 16
GROUP = 32
# type name -> (stored.c's code, values per checkpoint block, bytes per checkpoint block)
TYPES = {
    "F16": (1, 1, 2), "BF16": (2, 1, 2), "Q8_0": (3, 32, 34), "Q4_0": (4, 32, 18), "Q4_1": (5, 32, 20),
    "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q4_K": (8, 256, 144), "Q5_K": (9, 256, 176), "Q6_K": (10, 256, 210),
}


@dataclass
class StoredWeight:
    """A [N, K] weight in stored.c's layout: `packed` holds ceil(N/16) panels of K/32 groups."""
    kind: str
    shape: tuple[int, int]
    packed: torch.Tensor   # uint8

    @property
    def code(self) -> int:
        return TYPES[self.kind][0]

    def nbytes(self) -> int:
        return self.packed.numel()

    def expand(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        n, k = self.shape
        out = torch.empty(n, k)
        kernels.lib().probity_expand(self.code, self.packed.data_ptr(), n, k, out.data_ptr())
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the float32 weight (an embedding lookup)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.shape[1])
        kernels.lib().probity_expand_rows(self.code, self.packed.data_ptr(), self.shape[1], ids.data_ptr(),
                                          ids.numel(), out.data_ptr())
        return out


def _fields(kind: str, raw: np.ndarray, n: int, k: int) -> dict[str, np.ndarray]:
    """The checkpoint's blocks [n, bytes per row] as integer fields per row and group of 32:
    d, m (float16 bits), sc, mn (small ints), q [n, G, 32] (the value of each position)."""
    _, per, size = TYPES[kind]
    if kind in ("F16", "BF16"):
        return {"h": np.ascontiguousarray(raw).view(np.uint16).reshape(n, k // 32, 32)}
    b = np.ascontiguousarray(raw).reshape(n, k // per, size)
    if per == 32:
        f = {"d": b[..., 0:2].copy().view(np.uint16)[..., 0]}
        if kind == "Q8_0":
            f["q"] = b[..., 2:].view(np.int8).astype(np.int32)
            return f
        off = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[kind]
        if kind in ("Q4_1", "Q5_1"):
            f["m"] = b[..., 2:4].copy().view(np.uint16)[..., 0]
        qs = b[..., off:off + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)
        if kind in ("Q5_0", "Q5_1"):
            qh = b[..., off - 4:off].copy().view(np.uint32)[..., 0]
            q |= (((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)
        f["q"] = q
        return f
    # K-quants: a super-block of 256 values is 8 groups of 32
    if kind in ("Q4_K", "Q5_K"):
        d = b[..., 0:2].copy().view(np.uint16)[..., 0]
        dmin = b[..., 2:4].copy().view(np.uint16)[..., 0]
        s = b[..., 4:16].reshape(n, -1, 3, 4)
        dd, mm, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = np.concatenate([dd & 0x3F, (md & 0x0F) | ((dd >> 2) & 0x30)], axis=-1)   # [n, S, 8]
        mn = np.concatenate([mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30)], axis=-1)
        if kind == "Q4_K":
            qs = b[..., 16:144].reshape(n, -1, 4, 32)
        else:
            qh = b[..., 16:48]
            qs = b[..., 48:176].reshape(n, -1, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(n, -1, 8, 32).astype(np.int32)
        if kind == "Q5_K":
            q |= (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4).astype(np.int32)
        S = b.shape[1]
        return {"d": np.repeat(d, 8, axis=1), "m": np.repeat(dmin, 8, axis=1), "sc": sc.reshape(n, S * 8),
                "mn": mn.reshape(n, S * 8), "q": q.reshape(n, S * 8, 32)}
    # Q6_K
    ql, qh = b[..., 0:128], b[..., 128:192]
    scales = b[..., 192:208].view(np.int8)
    d = b[..., 208:210].copy().view(np.uint16)[..., 0]
    lo = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    hi = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    q = (lo.reshape(n, -1, 8, 32).astype(np.int32) | (hi.reshape(n, -1, 8, 32).astype(np.int32) << 4))
    S = b.shape[1]
    return {"d": np.repeat(d, 8, axis=1), "sc": scales[..., 0::2].reshape(n, S * 8),
            "mn": scales[..., 1::2].reshape(n, S * 8), "q": q.reshape(n, S * 8, 32)}


def pack(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> StoredWeight:
    """A checkpoint tensor (GGUF blocks, or 16-bit values, as bytes or as its own dtype) of
    logical shape [N, K] in stored.c's layout."""
    n, k = shape
    if kind not in TYPES:
        raise ValueError(f"weights of type {kind} cannot be kept as stored (supported: {', '.join(TYPES)})")
    if k % (GROUP if TYPES[kind][1] < 256 else 256):
        raise ValueError(f"a {kind} weight of {k} columns: not whole groups")
    f = _fields(kind, np.asarray(raw).view(np.uint8).reshape(n, -1), n, k)
    G, pad = k // GROUP, -n % PANEL

    def panels(a: np.ndarray) -> np.ndarray:
        """[n, G, ...] -> [P, G, 16, ...] (rows of a panel side by side within each group)."""
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        return np.ascontiguousarray(a.reshape(-1, PANEL, *a.shape[1:]).swapaxes(1, 2))

    parts: list[np.ndarray] = []
    if kind in ("F16", "BF16"):
        parts.append(panels(f["h"]).swapaxes(-1, -2).astype(np.uint16))        # [P, G, 32, 16]
    else:
        parts.append(panels(f["d"]).astype(np.uint16))                          # [P, G, 16]
        if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            parts.append(panels(f["m"]).astype(np.uint16))
        if kind in ("Q4_K", "Q5_K"):
            parts += [panels(f["sc"]).astype(np.uint8), panels(f["mn"]).astype(np.uint8)]
        if kind == "Q6_K":
            parts += [panels(f["sc"]).astype(np.int8), panels(f["mn"]).astype(np.int8)]
        q = panels(f["q"])                                                      # [P, G, 16, 32]
        if kind == "Q8_0":
            parts.append(q.swapaxes(-1, -2).astype(np.int8))                    # [P, G, 32, 16]
        else:
            low = (q & 0x0F).astype(np.uint8)
            parts.append((low[..., :16] | (low[..., 16:] << 4)).swapaxes(-1, -2))  # [P, G, 16(j), 16(rows)]
            if kind in ("Q5_0", "Q5_1", "Q5_K"):
                bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
                parts.append(bits.sum(-1, dtype=np.uint32))                     # [P, G, 16]
            if kind == "Q6_K":
                two = ((q >> 4) & 3).astype(np.uint32)
                parts.append((two[..., :16] << (2 * np.arange(16, dtype=np.uint32))).sum(-1, dtype=np.uint32))
                parts.append((two[..., 16:] << (2 * np.arange(16, dtype=np.uint32))).sum(-1, dtype=np.uint32))
    P = parts[0].shape[0]
    flat = np.concatenate([p.reshape(P, G, -1).view(np.uint8) for p in parts], axis=-1)
    assert flat.shape[-1] == kernels.lib().probity_group_bytes(TYPES[kind][0]), (kind, flat.shape)
    return StoredWeight(kind, (n, k), torch.from_numpy(np.ascontiguousarray(flat).reshape(-1)))


def from_tensor(t: torch.Tensor) -> StoredWeight:
    """A bf16 or f16 tensor [N, K] kept as it is."""
    kind = {torch.bfloat16: "BF16", torch.float16: "F16"}[t.dtype]
    return pack(kind, t.detach().contiguous().view(torch.uint16).numpy(), tuple(t.shape))
