"""Which sequences run in the next forward, and how many of their tokens.

One step holds at most `step_tokens` token rows: first one token for every running sequence
that is decoding, then prompt chunks of running sequences still in prefill, then new
sequences from the waiting queue (FIFO) while there is room. When the KV pool cannot hold a
sequence's next tokens, the most recently admitted running sequence is preempted: its blocks
are freed and it waits to be recomputed from scratch (batch invariance makes the recomputed
numbers identical)."""
from __future__ import annotations

from collections import deque

from .kv_cache import BlockPool
from .sequence import Request, Sequence, Status


class Scheduler:
    def __init__(self, pool: BlockPool, max_running: int, step_tokens: int):
        self.pool = pool
        self.max_running = max_running
        self.step_tokens = step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

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
        while self.waiting and budget and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = min(seq.remaining, budget)
            if not self.pool.can_grow(seq.blocks, seq.num_computed + n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.pool.grow(seq.blocks, seq.num_computed + n)
            batch.append((seq, n))
            budget -= n
        return batch

    def preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.num_computed = 0
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
        for seq in req.sequences:
            if seq.status is not Status.FINISHED:
                self.finish(seq)
