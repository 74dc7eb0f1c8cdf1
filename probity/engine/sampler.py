"""Sampling: the next token from a row of raw logits, with the request's bias, penalties,
temperature, top-k and top-p, from the choice's own seeded stream. What is reported about a
token (tables.py) is the raw distribution, whatever shaped the draw."""
from __future__ import annotations

import struct

import numpy as np
import torch

from ..protocol import Sampling, choice_seed
from .sequence import Sequence


def sample(logits: torch.Tensor, seq: Sequence, mask: torch.Tensor | None = None) -> int:
    """Pick the next token from one row of raw logits (`mask`: the tokens its grammar allows)."""
    s: Sampling = seq.request.sampling
    x = logits.float().clone()
    if s.logit_bias:
        ids = torch.tensor(list(s.logit_bias.keys()))
        x[ids] += torch.tensor(list(s.logit_bias.values()), dtype=x.dtype)
    if (s.presence_penalty or s.frequency_penalty) and seq.counts is not None:
        c = seq.counts
        x -= s.frequency_penalty * c + s.presence_penalty * (c > 0).float()
    if mask is not None:
        x.masked_fill_(~mask, -torch.inf)
    if s.temperature == 0.0:
        return int(torch.argmax(x))  # first maximum: the lowest id among ties
    scaled = x / s.temperature
    if not torch.isfinite(scaled.max()):
        return int(torch.argmax(x))  # overflowed: the greedy limit (docs/api.md, `temperature`)
    x = scaled
    if s.top_p == 1.0 and not (s.top_k and s.top_k < x.numel()):
        # no truncation: draw in token-id order, no sort of the vocabulary needed
        sorted_x, order = x, None
    else:
        sorted_x, order = torch.sort(x, descending=True, stable=True)
        if s.top_k and s.top_k < sorted_x.numel():
            sorted_x, order = sorted_x[: s.top_k], order[: s.top_k]
    probs = torch.softmax(sorted_x.double(), dim=-1)
    if s.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)  # sorted most likely first here
        keep = int(torch.searchsorted(cum, torch.tensor([s.top_p], dtype=cum.dtype)).item()) + 1
        probs = probs[:keep]
        order = order[:keep]
    cum = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=seq.generator, dtype=torch.float64) * cum[-1]
    pick = min(int(torch.searchsorted(cum, u.reshape(1), right=True).item()), cum.numel() - 1)
    return pick if order is None else int(order[pick])


def plain(seq: Sequence) -> bool:
    """Sampling with at most a logit bias and a temperature: what sample_many does for many
    rows at once."""
    s: Sampling = seq.request.sampling
    return (s.top_p == 1.0 and not s.top_k and not s.presence_penalty and not s.frequency_penalty)


def sample_many(rows: list[torch.Tensor], seqs: list[Sequence], masks: list[torch.Tensor | None] | None = None
                ) -> list[int]:
    """`sample(rows[j], seqs[j], masks[j])` for every j, the plain ones in a few batched ops.
    Every op here works row by row (argmax, softmax, cumsum and searchsorted along the
    vocabulary), so a row draws the same token whatever rows share the call;
    tests/test_sampling.py checks it against `sample` one row at a time. A mask (a grammar's
    allowed tokens, never empty) sets the others to -inf before the draw: they get no
    probability, and the rest keep their ratios."""
    masks = masks or [None] * len(seqs)
    out: list[int | None] = [None] * len(seqs)
    batch = [j for j, q in enumerate(seqs) if plain(q)]
    for j, q in enumerate(seqs):
        if not plain(q):
            out[j] = sample(rows[j], q, masks[j])
    if not batch:
        return out
    x = torch.stack([rows[j] for j in batch]).float()
    biases = [(r, seqs[j].request.sampling.logit_bias) for r, j in enumerate(batch)]
    biased = [(r, b) for r, b in biases if b]
    if biased:  # every biased entry at once: x[r, id] + bias, as the one-row path adds it
        at_r = torch.tensor([r for r, b in biased for _ in b])
        at_id = torch.tensor([i for _, b in biased for i in b])
        add = torch.tensor([v for _, b in biased for v in b.values()], dtype=x.dtype)
        x.index_put_((at_r, at_id), x[at_r, at_id] + add)
    for r, j in enumerate(batch):
        if masks[j] is not None:
            x[r].masked_fill_(~masks[j], -torch.inf)
    temps: dict[float, list[int]] = {}
    for r, j in enumerate(batch):
        temps.setdefault(seqs[j].request.sampling.temperature, []).append(r)
    greedy = temps.pop(0.0, [])
    if greedy:
        for r, tok in zip(greedy, torch.argmax(x[greedy], dim=-1).tolist()):  # first maximum
            out[batch[r]] = tok
    if temps:
        drawn = [r for rs in temps.values() for r in rs]
        if len(temps) == 1 and len(drawn) == len(batch):  # one temperature for every row
            t = next(iter(temps))
            scaled = x if t == 1.0 else x / t   # x / 1 is x, bit for bit
        else:
            scaled = torch.cat([x[rs] / t for t, rs in temps.items()])
        # A temperature so small that logit / temperature overflows float32 samples its limit,
        # the greedy token, and draws nothing (as `sample` does).
        finite = torch.isfinite(scaled.amax(dim=-1)).tolist()
        if not all(finite):
            for r, ok in zip(drawn, finite):
                if not ok:
                    out[batch[r]] = int(torch.argmax(x[r]))
            keep = [i for i, ok in enumerate(finite) if ok]
            drawn = [drawn[i] for i in keep]
            scaled = scaled[keep]
    if temps and drawn:
        cum = torch.cumsum(torch.softmax(scaled.double(), dim=-1), dim=-1)
        u = torch.stack([torch.rand((), generator=seqs[batch[r]].generator, dtype=torch.float64) for r in drawn])
        u = u * cum[:, -1]
        picks = torch.searchsorted(cum, u[:, None], right=True)[:, 0].clamp_(max=cum.shape[1] - 1).tolist()
        for r, tok in zip(drawn, picks):
            out[batch[r]] = tok
    return out


_MT_N = 624
_STATE_BYTES = 5056  # torch's CPU generator state: {u64 seed; i32 left, seeded; u64 next; u64 mt[624]; ...}


def new_generator(seed: int | None, choice: int) -> torch.Generator:
    """The sampling stream of one choice. torch's own manual_seed keeps only 32 bits of a
    seed; here all 64 are used: the Mersenne Twister state is numpy's
    MT19937(SeedSequence(choice_seed(seed, choice))), positioned as numpy positions it,
    so the stream is exactly that generator's (docs/api.md, `seed`)."""
    g = torch.Generator()
    if seed is None:
        g.seed()
        return g
    s = choice_seed(seed, choice)
    key = np.random.SeedSequence(s).generate_state(_MT_N, np.uint32).astype("<u8")
    key[0] = 0x80000000  # numpy's guard against an all-zero state
    state = bytearray(g.get_state().numpy().tobytes())
    if len(state) != _STATE_BYTES:
        raise RuntimeError(f"unexpected torch generator state size {len(state)}")
    # left=2, next=623: the next draw is mt[623] untwisted, then a twist, as numpy's pos=623
    struct.pack_into("<QiiQ", state, 0, s, 2, 1, _MT_N - 1)
    state[24:24 + 8 * _MT_N] = key.tobytes()
    g.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    return g
