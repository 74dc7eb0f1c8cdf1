"""A request's state in the engine, whichever backend runs it: one Request per SUBMIT, one
Choice per member × choice (the tokens it has produced, how it ended)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..protocol import Sampling
from .stop_text import StopText


@dataclass(eq=False, kw_only=True)
class Choice:
    """One member × one choice of a request: the tokens it has produced and how it ended."""
    request: "Request"
    member: int
    choice: int
    prompt: list[int]
    stop_text: StopText
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_matched: str | None = None
    cached_tokens: int | None = None  # prompt tokens the backend took from its prefix cache
    held: list[dict] = field(default_factory=list)  # entries waiting for the member's echo to finish
    matcher: Any = None  # its grammar's llguidance matcher (engine/grammar.py), or None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def done_budget(self) -> bool:
        return len(self.out) >= self.request.sampling.max_tokens


@dataclass(eq=False)
class Request:
    id: int
    sampling: Sampling
    prompts: list[list[int]]
    choices: list[Choice] = field(default_factory=list)
    echo_next: dict[int, int] = field(default_factory=dict)  # member -> next prompt position its ECHO owes
    template: dict[int, list[bool]] = field(default_factory=dict)  # messages member -> its tokens' template flags
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float | None = None   # the first forward that ran it (the backend sets it)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def finished(self) -> bool:
        return all(q.finished for q in self.choices)
