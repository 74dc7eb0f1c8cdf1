"""Tensors in, logits out: one forward over every scheduled sequence's new tokens, then the
head and the log-softmax only for the rows somebody asked about (echo positions, the row a
token is sampled from), in chunks of at most `head_rows` rows, so peak memory is set by the
flags and not by the request."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import BlockPool
from .model import KEY_ALIGN, AttnGroup, Model
from .sampler import top_tables
from .sequence import Sequence

BLOCK_SIZE = 16


@dataclass
class SeqResult:
    """What one step produced for one sequence."""
    echo: list[tuple[int, float, list | None]] = field(default_factory=list)  # (position, logprob, table)
    logits: torch.Tensor | None = None   # raw logits of the row to sample from
    lp: torch.Tensor | None = None       # its log-softmax


class ModelRunner:
    def __init__(self, hf_model, threads: int | None = None, kv_cache_gib: float = 2.0,
                 head_rows: int = 128, num_blocks: int | None = None, prefix_cache: bool = True):
        if threads:
            torch.set_num_threads(threads)
        cfg = hf_model.config
        per_block = Model.bytes_per_token(cfg) * BLOCK_SIZE
        num_blocks = num_blocks or max(2, int(kv_cache_gib * (1 << 30)) // per_block + 1)
        self.pool = BlockPool(num_blocks, BLOCK_SIZE, prefix_cache)
        self.model = Model(hf_model, num_blocks, BLOCK_SIZE)
        self.vocab_size = self.model.vocab_size
        ctx = int(getattr(cfg, "max_position_embeddings", 2048))
        window = getattr(cfg, "sliding_window", None)
        if isinstance(window, int) and window > 0:
            ctx = min(ctx, window)  # within the window, sliding attention is full attention
        self.context_length = min(ctx, self.pool.capacity_tokens)
        self.head_rows = head_rows
        self.align = KEY_ALIGN // BLOCK_SIZE

    def _table(self, seq: Sequence, length: int, nb: int) -> list[int]:
        used = seq.blocks[: self.pool.blocks_for(length)]
        return used + [0] * (nb - len(used))

    def _groups(self, batch: list[tuple[Sequence, int]], starts: list[int]) -> list[AttnGroup]:
        """Decoding sequences attend together; each prompt chunk attends alone."""
        def padded_blocks(length: int) -> int:
            nb = self.pool.blocks_for(length)
            return -(-nb // self.align) * self.align

        groups = []
        decode = [(i, seq) for i, (seq, n) in enumerate(batch) if n == 1]
        if decode:
            nb = max(padded_blocks(seq.num_computed + 1) for _, seq in decode)
            groups.append(AttnGroup(
                starts=[starts[i] for i, _ in decode], rows=1,
                qpos=torch.tensor([[seq.num_computed] for _, seq in decode]),
                tables=torch.tensor([self._table(seq, seq.num_computed + 1, nb) for _, seq in decode])))
        for i, (seq, n) in enumerate(batch):
            if n > 1:
                end = seq.num_computed + n
                nb = padded_blocks(end)
                groups.append(AttnGroup(
                    starts=[starts[i]], rows=n, qpos=torch.arange(seq.num_computed, end)[None, :],
                    tables=torch.tensor([self._table(seq, end, nb)])))
        return groups

    @torch.inference_mode()
    def forward(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int]]:
        """The final hidden rows of every sequence's next `n` positions (whose blocks the
        scheduler has allocated), and where each sequence's rows start."""
        tokens, positions, slots, starts = [], [], [], []
        bs = self.pool.block_size
        for seq, n in batch:
            starts.append(len(tokens))
            a = seq.num_computed
            tokens += seq.tokens[a:a + n]
            for p in range(a, a + n):
                positions.append(p)
                slots.append(seq.blocks[p // bs] * bs + p % bs)
        hidden = self.model.forward(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots),
                                    self._groups(batch, starts))
        return hidden, starts

    @torch.inference_mode()
    def step(self, batch: list[tuple[Sequence, int]], wants_sample) -> list[SeqResult]:
        """Run one forward. `wants_sample(seq)` says whether a token is to be sampled once the
        sequence's positions are all computed. Does not advance `num_computed`."""
        hidden, starts = self.forward(batch)
        # which rows need the head: (row, seq index, kind, position). Echo rows come from the
        # pool of final hidden states, so positions served by the prefix cache have theirs.
        bs = self.pool.block_size
        wanted: list[tuple[int, int, str, int]] = []
        echo_slots = []
        for i, (seq, n) in enumerate(batch):
            a = seq.num_computed
            if seq.echo_next:
                for p in range(seq.echo_next, min(a + n, len(seq.prompt) - 1) + 1):
                    wanted.append((len(hidden) + len(echo_slots), i, "echo", p))
                    echo_slots.append(seq.blocks[(p - 1) // bs] * bs + (p - 1) % bs)
            if a + n == len(seq.tokens) and wants_sample(seq):
                wanted.append((starts[i] + n - 1, i, "sample", 0))
        rows = torch.cat([hidden, self.model.hidden_at(torch.tensor(echo_slots))]) if echo_slots else hidden
        results = [SeqResult() for _ in batch]
        for c in range(0, len(wanted), self.head_rows):
            chunk = wanted[c:c + self.head_rows]
            logits = self.model.logits(rows[torch.tensor([w[0] for w in chunk])])
            lp = torch.log_softmax(logits, dim=-1)
            echo_rows: dict[int, list[int]] = {}
            for j, (_, i, kind, p) in enumerate(chunk):
                if kind == "sample":
                    results[i].logits, results[i].lp = logits[j].clone(), lp[j].clone()
                else:
                    echo_rows.setdefault(i, []).append(j)
            for i, js in echo_rows.items():
                seq = batch[i][0]
                pos = [chunk[j][3] for j in js]
                targets = [seq.prompt[p] for p in pos]
                sub = lp[torch.tensor(js)]
                vals = sub[torch.arange(len(js)), torch.tensor(targets)].tolist()
                k = seq.request.sampling.logprobs
                tables = top_tables(sub, targets, k) if k is not None else [None] * len(js)
                results[i].echo += list(zip(pos, vals, tables))
        return results
