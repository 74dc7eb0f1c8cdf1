"""The KV block pool: fixed-size blocks preallocated once, handed to sequences as block tables.

Block 0 is never handed out: it is the zero block that pads block tables to the aligned key
length. Running out of blocks is not an error here; the scheduler decides who waits or is
preempted (and recomputed)."""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least two blocks")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_grow(self, table: list[int], tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table) <= len(self.free)

    def grow(self, table: list[int], tokens: int) -> None:
        """Extend `table` to hold `tokens` positions (the caller checked can_grow)."""
        for _ in range(self.blocks_for(tokens) - len(table)):
            table.append(self.free.popleft())

    def release(self, table: list[int]) -> None:
        self.free.extend(table)
        table.clear()
