"""The engine child's log: one line per event on its stderr (the terminal), prefixed so it
reads apart from the server's."""
from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(f"[probity engine] {msg}", file=sys.stderr, flush=True)
