"""A choice as probity's engine runs it: its place in the scheduler and in the KV pool, its
sampling stream and its penalty counts."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .request import Choice


class Status(enum.Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


@dataclass(eq=False, kw_only=True)
class Sequence(Choice):
    generator: torch.Generator
    status: Status = Status.WAITING
    blocks: list[int] = field(default_factory=list)  # KV block table
    num_computed: int = 0         # leading positions whose K/V are in the pool
    digests: list = field(default_factory=list)  # prefix-cache chain digests of its full blocks
    registered: int = 0           # leading blocks offered to the prefix cache
    counts: torch.Tensor | None = None  # per-token counts of generated ids (penalties)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out if self.out else self.prompt

    @property
    def remaining(self) -> int:
        """Positions still to run before the next token can be sampled."""
        return len(self.prompt) + len(self.out) - self.num_computed

    @property
    def echo_next(self) -> int:
        """The next prompt position whose echo entry this sequence owes, or 0 for none (the
        choice 0 of a member with echo carries it; position 0 is sent at acceptance)."""
        return self.request.echo_next.get(self.member, 0) if self.choice == 0 else 0
