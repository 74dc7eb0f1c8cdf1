"""Which sequences run in the next forward, and how many of their tokens.

One step holds at most `step_tokens` token rows: first one token for every running sequence
that is decoding, then prompt chunks of running sequences still in prefill, then new
sequences from the waiting queue (FIFO) while there is room. When the KV pool cannot hold a
sequence's next tokens, the most recently admitted running sequence is preempted: its blocks
are freed and it waits to be recomputed from scratch (batch invariance makes the recomputed
numbers identical).

The scheduler owns the block pool: it hands out blocks, offers filled ones to the prefix
cache, and advances each sequence past the rows a step ran (`postprocess`)."""
from __future__ import annotations

from collections import deque

from .request import Request
from .kv_cache import BlockPool, chain
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_running: int, step_tokens: int,
                 prefix_cache: bool = True):
        self.pool = BlockPool(num_blocks, block_size, prefix_cache)
        self.max_running = max_running
        self.step_tokens = step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.query_tokens = 0   # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0     # ... and served from it

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def prompt_digests(self, prompt: list[int], salt: str | None) -> list[bytes]:
        """The prefix-cache chain of a prompt's full blocks, as admission looks them up (at least
        one row is always run, so the last position's block is left out)."""
        return self.pool.digests(prompt, len(prompt) - 1, salt)

    def cached_tokens(self, prompt: list[int], digests: list[bytes]) -> int:
        """What the prefix cache holds of this prompt now."""
        return min(self.pool.cached_prefix(digests) * self.pool.block_size, len(prompt))

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.step_tokens
        batch: list[tuple[Sequence, int]] = []
        scheduled: set[int] = set()
        for seq in sorted(self.running, key=lambda s: s.remaining > 1):  # decodes first, stable
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted in this loop
            n = min(seq.remaining, budget)
            while not self.pool.can_grow(seq.blocks, seq.num_computed + n):
                # the latest admitted sequence not already in this step's batch
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled and s is not seq), seq)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.pool.grow(seq.blocks, seq.num_computed + n)
            batch.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
        # Blocks this step's sequences fill completely (in-flight) can be shared by a sequence
        # admitted in the same step: every layer writes all of the step's K/V before any row
        # attends, so its rows read those blocks as if they had been cached, bit for bit (the
        # rows that fill them are computed the same way whoever reads them). Blocks a running
        # sequence fills in a later step are pending: a sequence that needs one waits for it
        # instead of computing the same prefix again (lm-eval's multiple-choice arrays: one
        # context, several continuations, computed once, in one step).
        share = self.pool.prefix_cache
        inflight: dict[bytes, int] = {}
        if share:
            for seq, n in batch:
                self._filling(seq, n, inflight)
        pending = {d for r in self.running for d in r.digests[r.registered:] if d not in inflight} if share else set()
        admitted = []
        for seq in self.waiting:
            if not budget or len(self.running) >= self.max_running:
                break
            tokens = seq.tokens
            if len(seq.digests) != (len(tokens) - 1) // self.pool.block_size:
                seq.digests = self.pool.digests(tokens, len(tokens) - 1, seq.request.sampling.cache_salt)  # >= 1 row runs
            shared = self.pool.prefix_blocks(seq.digests, inflight)
            hit = len(shared)
            if hit < len(seq.digests) and seq.digests[hit] in pending:
                continue
            bs = self.pool.block_size
            n = min(len(tokens) - hit * bs, budget)
            idle_hits = sum(1 for b in shared if self.pool.refs[b] == 0)
            if self.pool.blocks_for(hit * bs + n) - hit > len(self.pool.free) + len(self.pool.idle) - idle_hits:
                break
            self.pool.take(shared, seq.blocks)
            seq.registered, seq.num_computed = hit, hit * bs
            if seq.cached_tokens is None:
                seq.cached_tokens = min(hit * bs, len(seq.prompt))
                self.query_tokens += len(seq.prompt)
                self.hit_tokens += seq.cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.pool.grow(seq.blocks, seq.num_computed + n)
            batch.append((seq, n))
            admitted.append(seq)
            if share:
                self._filling(seq, n, inflight)
                pending.update(d for d in seq.digests[hit:] if d not in inflight)
            budget -= n
        for seq in admitted:
            self.waiting.remove(seq)
        return batch

    def _filling(self, seq: Sequence, n: int, inflight: dict[bytes, int]) -> None:
        """Note the blocks `seq` fills completely in this step (its next n positions)."""
        full = min((seq.num_computed + n) // self.pool.block_size, len(seq.digests))
        for j in range(seq.registered, full):
            inflight.setdefault(seq.digests[j], seq.blocks[j])

    def postprocess(self, batch: list[tuple[Sequence, int]]) -> int:
        """After the step's forward: each sequence has its next n positions in the pool, and
        the blocks they filled are offered to the prefix cache. Returns the prompt positions
        the step computed."""
        prompt_rows = 0
        for seq, n in batch:
            if seq.num_computed < len(seq.prompt):
                prompt_rows += min(n, len(seq.prompt) - seq.num_computed)
            seq.num_computed += n
            self._register(seq)
        return prompt_rows

    def _register(self, seq: Sequence) -> None:
        """Offer the sequence's newly filled blocks to the prefix cache."""
        bs = self.pool.block_size
        full = seq.num_computed // bs
        while len(seq.digests) < full:
            j = len(seq.digests)
            seq.digests.append(chain(seq.digests[-1] if seq.digests else b"", seq.tokens[j * bs:(j + 1) * bs]))
        for j in range(seq.registered, full):
            self.pool.register(seq.blocks[j], seq.digests[j])
        seq.registered = max(seq.registered, full)

    def preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.num_computed = seq.registered = 0
        seq.digests = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.pool.release(seq.blocks)

    def drop(self, req: Request) -> None:
        for seq in req.choices:
            if seq.status is not Status.FINISHED:
                self.finish(seq)
