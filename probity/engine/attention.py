"""Attention over the paged KV pool, computed so that a row's result does not depend on its
companions, its padding or the key length.

A group's keys are gathered from the pool (whole blocks, masked past each item's position)
and cut into fixed slices of KEY_ALIGN keys by absolute position; each slice's scores are one
small GEMM of the same shape whatever the key length, and `exp(s - max) @ [V | 1]` runs in
the same slices, so the softmax denominator comes out of the same GEMM as the values and is
reduced in the same order; masked positions contribute exact zeros, so the padded length
changes no bit. The slices' partial results are summed as a pairwise tree (a GEMM over the
whole length changes its reduction with the length). Sequences whose new rows and key
lengths fall in the same buckets share one batched GEMM (an AttnGroup, built by the runner);
an item's query rows are padded by repeating its last row up to its bucket. Each score and
each value sum is one FMA chain of the kernels (kernels.score_gemm, value_gemm) whatever the
row count, and the exp is the kernels' (kernels.exp_), so a row's result does not depend on its
companions, its padding or the CPU."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from . import kernels

KEY_ALIGN = kernels.SLICE   # attention key length is a multiple of this, and both GEMMs work in slices of it
EXP_FLOOR = -87.0           # softmax inputs are clamped here: exp(-87) is the smallest normal-range value it gives


class Kept(enum.Enum):
    """What a decode group does with the keys it gathers: KEEP them for the next step, or REUSE
    the ones kept last step (same sequences, same length, tables only grown), writing in only
    each item's new position."""
    KEEP = 1
    REUSE = 2


@dataclass(frozen=True)
class AttnGroup:
    """Query rows attended together: `items` sequences with `rows` query rows each, reading
    `nb` blocks each. Built once per step (runner.py) and used by every layer.

    An item with fewer new rows than `rows` is padded by repeating its last row (same query,
    same position); the padded results are computed like any other row and dropped. Items are
    in step order, so `dest` ascends: a group whose `dest` holds as many rows as the step holds
    every step row, in order."""
    items: int
    rows: int
    nb: int
    length: int                  # keys each item reads: nb blocks' positions
    idx: torch.Tensor            # [items*rows] the step rows whose queries are attended
    dest: torch.Tensor           # the step rows that receive the kept results
    keep: torch.Tensor | None    # which of the items*rows results are kept (None: all)
    lead: int                    # keys [0, lead) are visible to every row of every item (a multiple of KEY_ALIGN)
    visible: torch.Tensor        # [1, items, slices past lead, 1, rows, KEY_ALIGN] 1.0 where a key is visible, else 0.0
    hide: torch.Tensor           # the same, 0.0 where a key is visible, else -inf
    blocks: torch.Tensor         # [items*nb] the block table, padded with the zero block
    qpos: torch.Tensor           # [items, rows] each query row's position
    decode: bool = False         # every item has one new row (each keeps the first of its rows)
    pos: torch.Tensor | None = None      # decode groups: each item's position (it sees keys 0..pos)
    kept: Kept | None = None             # decode groups: whether the gathered keys are kept or reused
    new_at: torch.Tensor | None = None   # Kept.REUSE: each item's new position in the kept keys (items*L)
    windowed: dict = field(default_factory=dict, compare=False)  # window -> (visible, hide), built on first use

    def masks_for(self, window: int | None) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(lead, visible, hide) for a layer that sees all earlier keys (window None) or only
        the last `window` positions up to each row's own."""
        if window is None:
            return self.lead, self.visible, self.hide
        if window not in self.windowed:
            self.windowed[window] = masks(0, self.length, self.qpos.tolist(), window)
        return (0, *self.windowed[window])


def masks(lead: int, length: int, qpos: list[list[int]], window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, hide) for a group whose items' query rows sit at positions `qpos` (per item,
    per row) over keys [lead, length): laid out as the scores past `lead`, [1, items, slices,
    1, rows, KEY_ALIGN], the KV-head and query-head dims as 1s (built once per step, not per
    layer). A key is visible to a row at or after its position, and within `window` positions
    of it when the layer has a sliding window (as transformers: key > query - window)."""
    keys = torch.arange(lead, length).view(-1, 1, KEY_ALIGN)
    at = torch.tensor(qpos)[:, None, :, None]
    masked = keys[None] > at
    if window is not None:
        masked |= keys[None] <= at - window
    visible = (~masked).float()[None, :, :, None]
    hide = torch.zeros(masked.shape).masked_fill_(masked, float("-inf"))[None, :, :, None]
    return visible, hide


def tree_sum(part: torch.Tensor) -> torch.Tensor:
    """Sum over dim 2 as a pairwise tree: slice i is added to slice i + P/2, P the count rounded up
    to a power of two, and again on the first half. Trailing zero slices change no bit (x + 0 = x
    and the pairing of the others is the same), so the result does not depend on padding."""
    n = part.shape[2]
    p = 1 << (n - 1).bit_length()
    while p > 1:
        h = p // 2
        if n > h:
            part[:, :, : n - h] += part[:, :, h:n]
            n = h
        p = h
    return part[:, :, 0]


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, g: AttnGroup, scale: float,
           fused_decode: bool, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The group's attention output for the step rows `g.dest`, [len(dest), H, hd], from every
    step row's queries q [T, H, hd] and the group's keys [KV, items, L, hd] and values
    [KV, items, L, hd+1] (a column of ones: the softmax denominator). `fused_decode`: a decode
    group of one row per item runs in one kernel (the same operations, so the same bits).
    `window`: the layer sees only the last `window` positions; `softcap`: scores are squashed
    as cap * tanh(s / cap) before the softmax (Gemma 2)."""
    KV, hd = keys.shape[0], keys.shape[3]
    H = q.shape[1]
    G = H // KV
    items, n = g.items, g.rows
    if g.decode and n == 1 and fused_decode and window is None and softcap is None:
        return kernels.decode_attention(q, g.idx, keys, vals, g.pos, G, scale, g.lead, EXP_FLOOR)
    # queries [KV, items, G*n, hd], scaled before the GEMM
    qs = q.index_select(0, g.idx).mul_(scale).view(items, n, KV, G, hd).permute(2, 0, 3, 1, 4)
    qs = qs.reshape(KV, items, G * n, hd)
    # scores [KV, items, S, G*n, KEY_ALIGN], in slices of KEY_ALIGN keys: each score is one
    # dot product over the head dim, computed by a GEMM of the same shape for every slice
    s = kernels.score_gemm(keys, qs)
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    lead, visible, hide = g.masks_for(window)
    # softmax numerators: the maximum over visible keys, then exp(s - max) at visible keys and
    # an exact 0 elsewhere. Slices before `lead` hold keys visible to every row of the group,
    # so only the later ones are masked; a max is exact, so splitting it changes no bit.
    # Masked scores are multiplied by 0 before the exp (exp of -inf or of an underflowing
    # value takes a slow path, ~10x on the CPUs measured) and after it; a masked score is
    # finite (keys are zeros or values the model computed), so it becomes an exact 0. Visible
    # scores more than 87 below the maximum are raised to EXP_FLOOR: their exp would be a
    # subnormal float, ~10x slower to compute, and e^-87 = 1.6e-38 instead of less than
    # 1.2e-38 against a denominator >= 1 is the same weight for every purpose; the same for
    # every row, so nothing else moves.
    s0 = lead // KEY_ALIGN
    tail = s[:, :, s0:].view(KV, items, -1, G, n, KEY_ALIGN)
    top = torch.add(tail, hide).amax((2, 5)).view(KV, items, 1, G * n, 1)
    if s0:
        top = torch.maximum(top, s[:, :, :s0].amax((2, 4), keepdim=True))
    s.sub_(top).clamp_(min=EXP_FLOOR)
    tail.mul_(visible)
    kernels.exp_(s)
    tail.mul_(visible)
    # the value GEMM reduces over the keys in the same fixed slices, by absolute position: a
    # GEMM over the whole length may change its reduction with the length (it does on a
    # Sapphire Rapids past a few hundred keys), and then padding would change the bits. The
    # slices' partial results [KV, items, S, G*n, hd+1] are added as a pairwise tree, which
    # treats a count that is not a power of two as zero-padded to one, so padding the keys
    # (more slices of exact zeros) changes no bit.
    o = tree_sum(kernels.value_gemm(s, vals))          # [KV, items, G*n, hd+1]
    if g.decode:  # each item keeps its first row (the others repeat it)
        o = o.view(KV, items, G, n, hd + 1)[:, :, :, 0]
        return (o[..., :hd] / o[..., hd:]).permute(1, 0, 2, 3).reshape(items, H, hd)
    o = (o[..., :hd] / o[..., hd:]).view(KV, items, G, n, hd).permute(1, 3, 0, 2, 4).reshape(items * n, H, hd)
    return o if g.keep is None else o.index_select(0, g.keep)


class PagedKV:
    """Every layer's keys and values, in the blocks the scheduler hands out, and the attention
    that reads them. Block 0 is the zero block that pads block tables; it is never written. V
    carries a column of ones, so the softmax denominator comes out of the values' own GEMM.
    Head-major layout: gathering a sequence's blocks gives [KV, items, L, hd] as a view, so
    attention reads the keys in place of a transposed copy. One decode group's gathered keys
    and values are kept from step to step (the runner decides which: AttnGroup.kept)."""

    def __init__(self, layers: int, n_kv: int, head_dim: int, num_blocks: int, block_size: int):
        self.layers, self.n_kv, self.head_dim, self.block_size = layers, n_kv, head_dim, block_size
        self.k = torch.zeros(layers, n_kv, num_blocks, block_size, head_dim)
        self.v = torch.zeros(layers, n_kv, num_blocks, block_size, head_dim + 1)
        self.v[..., head_dim] = 1.0
        self.kept_k: list[torch.Tensor | None] = [None] * layers
        self.kept_v: list[torch.Tensor | None] = [None] * layers

    @staticmethod
    def bytes_per_token(layers: int, n_kv: int, head_dim: int) -> int:
        return layers * n_kv * (2 * head_dim + 1) * 4

    def nbytes(self) -> int:
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    def drop_kept(self) -> None:
        self.kept_k = [None] * self.layers
        self.kept_v = [None] * self.layers

    def write(self, li: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step rows' keys and values [T, KV, hd] into their pool slots."""
        KV, hd = self.n_kv, self.head_dim
        kernels.kv_store(k, v, slots, self.k[li].view(KV, -1, hd), self.v[li].view(KV, -1, hd + 1))

    def gather(self, li: int, k: torch.Tensor, v: torch.Tensor, g: AttnGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys [KV, items, L, hd] and values [KV, items, L, hd+1]: gathered from the
        pool, or the ones kept from the last step with this step's new positions written in.
        Both hold the same floats at every visible position (a position past an item's own
        length may be zero in one and stale in the other: it is masked, its weight an exact 0)."""
        KV, hd = self.n_kv, self.head_dim
        if g.kept is Kept.REUSE:
            keys, vals = self.kept_k[li], self.kept_v[li]
            kernels.kv_store(k, v, g.new_at, keys.view(KV, -1, hd), vals.view(KV, -1, hd + 1),
                             None if len(g.dest) == len(k) else g.dest)
            return keys, vals
        # whole blocks as flat rows: one contiguous copy per block
        keys = self.k[li].flatten(2).index_select(1, g.blocks).view(KV, g.items, g.length, hd)
        vals = self.v[li].flatten(2).index_select(1, g.blocks).view(KV, g.items, g.length, hd + 1)
        if g.kept is Kept.KEEP:
            self.kept_k[li], self.kept_v[li] = keys, vals
        return keys, vals

    def attention(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                  groups: list[AttnGroup], scale: float, fused_decode: bool, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        """Layer li's attention for every step row, [T, H, hd], from its queries q [T, H, hd]
        and new keys and values k, v [T, KV, hd] (written into the pool first)."""
        self.write(li, slots, k, v)
        if len(groups) == 1:  # then its kept rows are the step's rows, in order
            g = groups[0]
            return attend(q, *self.gather(li, k, v, g), g, scale, fused_decode, window, softcap)
        out = torch.empty(q.shape[0], q.shape[1], self.head_dim)
        for g in groups:
            out.index_copy_(0, g.dest, attend(q, *self.gather(li, k, v, g), g, scale, fused_decode, window, softcap))
        return out
