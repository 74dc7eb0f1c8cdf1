"""The transformer forward in plain torch: the one place that knows how a token row is computed.

Batch invariance is a property of this file: a row's result must not depend on which other
rows share the step, where it sits among them, how its prompt was chunked, or whether it is
computed in a prefill or in a decode. Each op is chosen for that, and tests/test_invariance.py
checks it bit for bit:

- Linear layers run through oneDNN with weights prepacked once (`_linear_pointwise`): every
  row is reduced in the same order whatever the row count (plain `F.linear` switches kernels
  with the row count below 16 rows). A call narrower than the floor measured at startup for
  its shape (`probe_linear`: a CPU's kernel may treat a single row apart) is padded. Calls of
  up to narrow.MAX_ROWS rows (decode steps) run through narrow.c instead, which streams the
  weights once and reduces in oneDNN's own order: `probe_linear` checks at startup, shape by
  shape, that it gives oneDNN's bits, and only then is it used.
- Attention gathers each sequence's keys from the paged pool (whole blocks, masked past its
  position), cuts them into fixed slices of KEY_ALIGN keys by absolute position, computes each
  slice's scores as one small GEMM of the same shape whatever the key length, and
  `exp(s - max) @ [V | 1]` in the same slices: the softmax denominator comes out of the same
  GEMM as the values, so it is reduced in the same order as they are; masked positions
  contribute exact zeros, so the padded length does not change a bit. The slices' partial
  results are summed as a pairwise tree (a GEMM over the whole length changes its reduction
  with the length). Sequences whose new rows and key lengths fall in the same buckets share one
  batched GEMM (AttnGroup); an item's query rows are padded by repeating its last row, up to
  a floor measured at startup on this CPU's kernels (`attention_min_rows`: narrow calls may
  reduce differently), so a row's result does not depend on its companions. Narrow attention
  calls run through narrow.c in MKL's own order (1 on the AMD EPYC of stop 23).
- Norms, rotary embeddings and activations are per-row or elementwise (the hidden-state norms
  in narrow.c, one fixed order per row).

Families: Llama, Mistral, Qwen2, Qwen3 (their weights read from the transformers module).
Anything else is refused at startup rather than served wrongly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import narrow

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
LINEAR_PROBE = (*range(1, 18), 24, 32, 48, 64, 96, 128, 256)   # row counts probe_linear compares
LINEAR_PROBE_WIDE = 512  # ... with the same rows of a call this wide
EXP_FLOOR = -87.0  # softmax inputs are clamped here: exp(-87) is the smallest normal-range value it gives
KEY_ALIGN = 64    # attention key length is a multiple of this, and the value GEMM reduces in slices of it


class UnsupportedModel(Exception):
    pass


def check_supported(config) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise UnsupportedModel(
            f"model type {kind!r} is not supported by probity's engine (supported: {', '.join(SUPPORTED)}); "
            "refusing to serve it rather than serve it wrongly")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        raise UnsupportedModel(f"rope type {rope!r} is not supported (its angles depend on the sequence length)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"activation {config.hidden_act!r} is not supported")
    if getattr(config, "use_sliding_window", False) and "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise UnsupportedModel("sliding-window attention layers are not supported")


class Linear:
    """y = x W^T + b through oneDNN with W prepacked once, or for calls of up to
    narrow.MAX_ROWS rows through narrow.c, which gives the same bits where probe_linear found
    so. `residual` says how the model calls it (with an add fused into the GEMM or not): the
    probe measures that call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: bool = False):
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float().contiguous()
        self.w = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.b = None if bias is None else bias.detach().float().contiguous()
        self.residual = residual
        self.min_rows = 1   # set from probe_linear before the first forward
        self.kb = None      # narrow.c's k-block, set from probe_linear where it equals oneDNN
        self.packed = narrow.pack(weight) if narrow.load() is not None else None

    def use_narrow(self, kb: int | None) -> None:
        self.kb = kb
        if kb is None:
            self.packed = None   # oneDNN serves every call of this shape; free the copy

    def gemm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.w, self.b, "add")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` when given: that add is done by the GEMM as it writes its
        output (one pass over the rows instead of two). It is the same IEEE add of the same two
        floats, so the bits are those of `residual + self(x)`."""
        n = x.shape[0]
        if self.kb is not None and n <= narrow.MAX_ROWS:
            return narrow.linear(x, self.packed, self.out_features, self.kb, self.b, residual)
        if n >= self.min_rows:
            return self.gemm(x, residual)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(self.min_rows - n, t.shape[1])])
        return self.gemm(pad(x), None if residual is None else pad(residual))[:n]


def probe_linear(lin: Linear) -> tuple[int, int | None]:
    """(floor, kb) for calls of `lin` on this CPU, from one wide oneDNN call on random data
    made as the model makes it (with or without the fused add).

    floor: the fewest rows a oneDNN call may have. Every row of a call with a count in
    LINEAR_PROBE is compared bit for bit with the same row of the LINEAR_PROBE_WIDE-row call,
    and the smallest count from which every larger one agrees is returned. On the AMD EPYC of
    stops 21-23 it is 1 for every linear of the default model, and on the Sapphire Rapids of
    stops 17-20 every count from 1 to 1,000 agreed too; the first look at this kernel, on an
    earlier CPU, saw a lone row reduced differently, and there it is padded.

    kb: the k-block with which narrow.c gives the wide call's bits for every count in
    narrow.PROBE_ROWS, or None (no candidate does, or the kernel is not built here): then
    oneDNN serves every call of this shape.

    A kernel's choice depends on the shapes, not on the values, so one probe serves every
    layer of a shape."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(LINEAR_PROBE_WIDE, lin.in_features, generator=gen)
    r = torch.randn(LINEAR_PROBE_WIDE, lin.out_features, generator=gen) if lin.residual else None
    wide = lin.gemm(x, r)
    bad = 0
    for m in LINEAR_PROBE:
        if not torch.equal(lin.gemm(x[:m], None if r is None else r[:m]), wide[:m]):
            bad = m
    kb = None
    if lin.packed is not None:
        kb = narrow.block_for(lin.packed, lin.out_features, lin.b, x, r, wide)
    return bad + 1, kb


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dim. The model's [rows, hidden] norms run
    in narrow.c, each row's sum of squares in one fixed order (4x faster than the six torch ops
    below on one row, and a row's bits cannot depend on the others); otherwise (the q/k norms
    of Qwen3, or no narrow.c) F.rms_norm's ops in its order, with the steps after the first
    done in place: a fresh buffer is memory the CPU must fetch before it writes it, and right
    after a GEMM has streamed its weights through the caches that fetch costs more than the
    arithmetic (a 250-row forward 1.07x faster, measured alternating in one process)."""
    if x.dim() == 2 and narrow.load() is not None:
        return narrow.rms_norm(x, w, eps)
    r = torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps))
    return torch.mul(x, r).mul_(w)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, x * cos + rotate_half(x) * sin, with rotate_half's negation carried by
    `signed_sin` (its first half negated): x2 * -s is exactly -(x2 * s), so the bits are those
    of the textbook form, one pass over the rows fewer."""
    if (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0
            and narrow.load() is not None):
        return narrow.rotate(x, cos, signed_sin)   # the same ops per element, one call
    half = x.shape[-1] // 2
    rot = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(signed_sin)
    return torch.mul(x, cos).add_(rot)


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


def score_gemm(keys: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Attention scores in slices of KEY_ALIGN keys, [KV, items, S, C, KEY_ALIGN], from keys
    [KV, items, L, hd] (L = S * KEY_ALIGN) and queries [KV, items, C, hd]: one small GEMM per
    slice, the queries as its rows and the slice's keys (read transposed in place) as its
    columns. Every call has the same shape whatever the key length, so a score's bits cannot
    depend on how far the keys are padded."""
    KV, items, L, hd = keys.shape
    if qs.shape[2] <= narrow.SCORE_MAX_ROWS and hd in narrow.HEAD_DIMS and narrow.load() is not None:
        return narrow.score(keys, qs)
    return torch.matmul(qs[:, :, None], keys.view(KV, items, L // KEY_ALIGN, KEY_ALIGN, hd).transpose(-1, -2))


def value_gemm(e: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """The value GEMM in the same slices: e [KV, items, S, C, KEY_ALIGN] (softmax numerators)
    and vals [KV, items, L, hd+1] give the slices' partial results [KV, items, S, C, hd+1]."""
    KV, items, S = e.shape[:3]
    if e.shape[3] <= narrow.VALUE_MAX_ROWS and narrow.load() is not None:
        return narrow.value(e, vals)
    return torch.matmul(e, vals.view(KV, items, S, KEY_ALIGN, vals.shape[-1]))


def attention_min_rows(head_dim: int, group: int, row_counts: list[int], probe_columns: int = 4096,
                       seed: int = 0) -> int:
    """The fewest query rows per item that attention may give its two GEMMs on this CPU.

    A GEMM kernel may reduce a row differently when the call has few rows: measured on an
    AMD EPYC (AVX2), both sliced GEMMs give rows 1-3 of a call other bits than from 4 on,
    for every head dim, key length and item count tried. So it is measured here, at startup,
    on the kernels `_attend` calls: for every per-item row count the runner can use
    (`row_counts`, ascending; grouped-query heads make `group` GEMM rows of each), both GEMMs
    are run on random data and every row compared bit for bit with the same row of the
    widest call. Returned: the smallest count from which every larger one agrees. Counts
    whose GEMM width is past `probe_columns` are checked at powers of two and at the widest
    (a kernel's choice below such widths is what varies; above it the reduction over
    head_dim does not)."""
    widest = row_counts[-1]
    probed = [r for r in row_counts
              if r * group <= probe_columns or r & (r - 1) == 0 or r == widest]
    gen = torch.Generator().manual_seed(seed)
    bad = 0
    for L, items in ((KEY_ALIGN, 1), (3 * KEY_ALIGN, 3)):
        keys = torch.randn(2, items, L, head_dim, generator=gen)
        vals = torch.randn(2, items, L, head_dim + 1, generator=gen)
        qs = torch.randn(2, items, widest * group, head_dim, generator=gen)
        e = torch.rand(2, items, L // KEY_ALIGN, widest * group, KEY_ALIGN, generator=gen)
        s_ref, v_ref = score_gemm(keys, qs), value_gemm(e, vals)
        for r in probed[:-1]:
            c = r * group
            if not (torch.equal(score_gemm(keys, qs[:, :, :c]), s_ref[..., :c, :])
                    and torch.equal(value_gemm(e[..., :c, :].contiguous(), vals), v_ref[..., :c, :])):
                bad = max(bad, r)
    return next(r for r in row_counts if r > bad)


@dataclass
class Layer:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    ln_in: torch.Tensor
    ln_post: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


@dataclass
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
    idx: torch.Tensor            # [items*rows] the step rows whose queries are attended
    dest: torch.Tensor           # the step rows that receive the kept results
    keep: torch.Tensor | None    # which of the items*rows results are kept (None: all)
    lead: int                    # keys [0, lead) are visible to every row of every item (a multiple of KEY_ALIGN)
    visible: torch.Tensor        # [1, items, slices past lead, 1, rows, KEY_ALIGN] 1.0 where a key is visible, else 0.0
    hide: torch.Tensor           # the same, 0.0 where a key is visible, else -inf
    blocks: torch.Tensor         # [items*nb] the block table, padded with the zero block
    # decode groups only: "keep" = gather the keys and keep them for the next step; "reuse" =
    # the kept keys are this group's (same sequences, same length, tables only grown), so only
    # the new position of each item (`new_at`, in items*L) is written into them
    kept: str | None = None
    pos: torch.Tensor | None = None   # decode groups: each item's position (it sees keys 0..pos)
    new_at: torch.Tensor | None = None
    members: list | None = None  # decode groups: the sequences, in item order


class Model:
    def __init__(self, hf_model, num_blocks: int, block_size: int, calibration=None):
        cfg = hf_model.config
        check_supported(cfg)
        self.cfg = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.eps = float(cfg.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        # decode groups' attention in narrow.c (two calls instead of ~20 ops; the same bits)
        self.fused_decode = (narrow.load() is not None and self.head_dim in narrow.HEAD_DIMS and self.group <= 16)
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight.detach().float()
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.detach().float()
        self.rope_scaling = float(rot.attention_scaling)
        self.norm = inner.norm.weight.detach().float()
        self.head = Linear(hf_model.get_output_embeddings().weight)
        self.vocab_size = self.head.out_features
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            cat_bias = None
            if a.q_proj.bias is not None:
                cat_bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            self.layers.append(Layer(
                qkv=Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), cat_bias),
                o=Linear(a.o_proj.weight, a.o_proj.bias, residual=True),
                gate_up=Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                down=Linear(m.down_proj.weight, residual=True),
                ln_in=layer.input_layernorm.weight.detach().float(),
                ln_post=layer.post_attention_layernorm.weight.detach().float(),
                q_norm=a.q_norm.weight.detach().float() if hasattr(a, "q_norm") else None,
                k_norm=a.k_norm.weight.detach().float() if hasattr(a, "k_norm") else None,
            ))
        # each linear's oneDNN row floor and narrow.c block, measured once per shape and kind of
        # call (or read back from the calibration cache, verified)
        probes: dict[tuple, tuple[int, int | None]] = {}
        for lin in [self.head] + [x for l in self.layers for x in (l.qkv, l.o, l.gate_up, l.down)]:
            key = (lin.out_features, lin.in_features, lin.b is not None, lin.residual)
            if key not in probes:
                probes[key] = calibration.linear(lin) if calibration is not None else probe_linear(lin)
            lin.min_rows = probes[key][0]
            lin.use_narrow(probes[key][1])
        self.linear_probes = probes
        self.block_size = block_size
        self.num_blocks = num_blocks
        L, kv, hd = len(self.layers), self.n_kv, self.head_dim
        # Block 0 is the zero block that pads block tables; it is never written. V carries a
        # column of ones, so the softmax denominator comes out of the values' own GEMM.
        # Head-major layout: gathering a sequence's blocks gives [kv, items, L, hd] as a view,
        # so attention reads the keys in place of a transposed copy.
        self.k_pool = torch.zeros(L, kv, num_blocks, block_size, hd)
        self.v_pool = torch.zeros(L, kv, num_blocks, block_size, hd + 1)
        self.v_pool[..., hd] = 1.0
        # each position's final hidden state, so echo for a cached prefix is the head over the
        # very rows that were computed (the head is row-invariant: identical logits)
        self.h_pool = torch.zeros(num_blocks, block_size, cfg.hidden_size)
        # one decode group's gathered keys and values per layer, kept from step to step
        self.kept_k: list[torch.Tensor | None] = [None] * L
        self.kept_v: list[torch.Tensor | None] = [None] * L

    @staticmethod
    def bytes_per_token(cfg) -> int:
        n_heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        return (cfg.num_hidden_layers * kv * (2 * hd + 1) + cfg.hidden_size) * 4

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                groups: list[AttnGroup]) -> torch.Tensor:
        """Run the step's rows (all sequences' new tokens), writing their K/V into the pool at
        `slots`; returns the final hidden states [rows, hidden] (before the head)."""
        T = tokens.shape[0]
        h = self.embed[tokens]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling)[:, None, :]
        sin = (emb.sin() * self.rope_scaling)[:, None, :]
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)   # rotate()'s signed sin
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        for li, layer in enumerate(self.layers):
            x = rms_norm(h, layer.ln_in, self.eps)
            qkv = layer.qkv(x)
            v = qkv[:, (H + KV) * hd:].view(T, KV, hd)
            if layer.q_norm is None:
                qk = rotate(qkv[:, : (H + KV) * hd].view(T, H + KV, hd), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            else:
                q = rotate(rms_norm(qkv[:, : H * hd].view(T, H, hd), layer.q_norm, self.eps), cos, sin)
                k = rotate(rms_norm(qkv[:, H * hd: (H + KV) * hd].view(T, KV, hd), layer.k_norm, self.eps), cos, sin)
            self.k_pool[li].view(KV, -1, hd).index_copy_(1, slots, k.transpose(0, 1))
            self.v_pool[li].view(KV, -1, hd + 1)[:, :, :hd].index_copy_(1, slots, v.transpose(0, 1))
            if len(groups) == 1:  # then its kept rows are the step's rows, in order
                attn = self._attend(li, q, k, v, groups[0])
            else:
                attn = torch.empty(T, H, hd)
                for g in groups:
                    attn.index_copy_(0, g.dest, self._attend(li, q, k, v, g))
            h = layer.o(attn.reshape(T, H * hd), residual=h)
            x = rms_norm(h, layer.ln_post, self.eps)
            gu = layer.gate_up(x)
            inter = gu.shape[1] // 2
            h = layer.down(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), residual=h)
        h = rms_norm(h, self.norm, self.eps)
        self.h_pool.view(-1, h.shape[1])[slots] = h
        return h

    def hidden_at(self, slots: torch.Tensor) -> torch.Tensor:
        return self.h_pool.view(-1, self.h_pool.shape[-1])[slots]

    def drop_kept(self) -> None:
        self.kept_k = [None] * len(self.layers)
        self.kept_v = [None] * len(self.layers)

    def _keys(self, li: int, k: torch.Tensor, v: torch.Tensor, g: AttnGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys [KV, items, L, hd] and values [KV, items, L, hd+1]: gathered from the
        pool, or the ones kept from the last step with this step's new positions written in.
        Both hold the same floats at every visible position (a position past an item's own
        length may be zero in one and stale in the other: it is masked, its weight an exact 0)."""
        KV, hd = self.n_kv, self.head_dim
        L = g.nb * self.block_size
        if g.kept == "reuse":
            keys, vals = self.kept_k[li], self.kept_v[li]
            if len(g.dest) != len(k):
                k, v = k.index_select(0, g.dest), v.index_select(0, g.dest)
            keys.view(KV, -1, hd).index_copy_(1, g.new_at, k.transpose(0, 1))
            vals.view(KV, -1, hd + 1)[:, :, :hd].index_copy_(1, g.new_at, v.transpose(0, 1))
            return keys, vals
        # whole blocks as flat rows: one contiguous copy per block
        keys = self.k_pool[li].flatten(2).index_select(1, g.blocks).view(KV, g.items, L, hd)
        vals = self.v_pool[li].flatten(2).index_select(1, g.blocks).view(KV, g.items, L, hd + 1)
        if g.kept == "keep":
            self.kept_k[li], self.kept_v[li] = keys, vals
        return keys, vals

    def _attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AttnGroup) -> torch.Tensor:
        """The group's attention output for the step rows `g.dest`, [len(dest), H, hd]."""
        H, KV, hd, G = self.n_heads, self.n_kv, self.head_dim, self.group
        items, n = g.items, g.rows
        L = g.nb * self.block_size
        if g.members is not None and n == 1 and self.fused_decode:
            keys, vals = self._keys(li, k, v, g)
            return narrow.decode_attention(q, g.idx, keys, vals, g.pos, G, self.scale, g.lead, EXP_FLOOR)
        # queries [KV, items, G*n, hd], scaled before the GEMM
        qs = q.index_select(0, g.idx).mul_(self.scale).view(items, n, KV, G, hd).permute(2, 0, 3, 1, 4)
        qs = qs.reshape(KV, items, G * n, hd)
        keys, vals = self._keys(li, k, v, g)
        # scores [KV, items, S, G*n, KEY_ALIGN], in slices of KEY_ALIGN keys: each score is one
        # dot product over the head dim, computed by a GEMM of the same shape for every slice
        s = score_gemm(keys, qs)
        # softmax numerators: the maximum over visible keys, then exp(s - max) at visible keys and
        # an exact 0 elsewhere. Slices before `lead` hold keys visible to every row of the group,
        # so only the later ones are masked; a max is exact, so splitting it changes no bit.
        # Masked scores are multiplied by 0 before the exp (exp of -inf or of an underflowing
        # value takes a slow path, ~10x on this CPU) and after it; a masked score is finite
        # (keys are zeros or values the model computed), so it becomes an exact 0. Visible
        # scores more than 87 below the maximum are raised to EXP_FLOOR: their exp would be a
        # subnormal float, which this CPU computes ~10x slower (a decode step's exps 1.9 ms ->
        # ~0.3 ms), and e^-87 = 1.6e-38 instead of less than 1.2e-38 against a denominator >= 1
        # is the same weight for every purpose; the same for every row, so nothing else moves.
        s0 = g.lead // KEY_ALIGN
        tail = s[:, :, s0:].view(KV, items, -1, G, n, KEY_ALIGN)
        vis = g.visible
        top = torch.add(tail, g.hide).amax((2, 5)).view(KV, items, 1, G * n, 1)
        if s0:
            top = torch.maximum(top, s[:, :, :s0].amax((2, 4), keepdim=True))
        s.sub_(top).clamp_(min=EXP_FLOOR)
        tail.mul_(vis)
        s.exp_()
        tail.mul_(vis)
        # the value GEMM reduces over the keys in the same fixed slices, by absolute position: a
        # GEMM over the whole length may change its reduction with the length (it does on a
        # Sapphire Rapids past a few hundred keys), and then padding would change the bits. The
        # slices' partial results [KV, items, S, G*n, hd+1] are added as a pairwise tree, which
        # treats a count that is not a power of two as zero-padded to one, so padding the keys
        # (more slices of exact zeros) changes no bit.
        o = tree_sum(value_gemm(s, vals))          # [KV, items, G*n, hd+1]
        if g.members is not None:  # decodes: each item keeps its first row (the others repeat it)
            o = o.view(KV, items, G, n, hd + 1)[:, :, :, 0]
            return (o[..., :hd] / o[..., hd:]).permute(1, 0, 2, 3).reshape(items, H, hd)
        o = (o[..., :hd] / o[..., hd:]).view(KV, items, G, n, hd).permute(1, 3, 0, 2, 4).reshape(items * n, H, hd)
        return o if g.keep is None else o.index_select(0, g.keep)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
