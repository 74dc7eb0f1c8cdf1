"""A request's state in the vLLM backend: one Req per SUBMIT, one Seq per member x choice
(each one vLLM request with n=1)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.sequence import Sampling, StopText


@dataclass
class Seq:
    """One member x one choice: one vLLM request."""
    member: int
    choice: int
    vid: str
    prompt: list[int]
    stop_text: StopText
    echo: bool                       # this sequence carries its member's ECHO (choice 0)
    generated: int = 0
    echo_sent: int = 0               # prompt positions already sent
    finish_reason: str | None = None
    stop_matched: str | None = None
    cached_tokens: int = 0
    held: list[dict] = field(default_factory=list)  # tokens waiting for the member's ECHO

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Req:
    id: int
    sampling: Sampling
    prompts: list[list[int]]
    seqs: list[Seq] = field(default_factory=list)
    t_accept: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    echo_done: set = field(default_factory=set)   # members whose ECHO is complete

    @property
    def finished(self) -> bool:
        return all(q.finished for q in self.seqs)
