"""Which sequences run next: admit waiting sequences (prefill) first, then decode the running ones."""
from __future__ import annotations

from collections import deque

from .sequence import Request, Sequence, Status


class Scheduler:
    def __init__(self, max_running: int):
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill). One step advances every running sequence by one token,
        unless a waiting sequence can be admitted, which is prefilled first."""
        if self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            return [seq], True
        return list(self.running), False

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        seq.cache = None
        if seq in self.running:
            self.running.remove(seq)

    def drop(self, req: Request) -> None:
        for seq in req.sequences:
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
            self.finish(seq)
