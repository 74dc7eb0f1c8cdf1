"""Where the engine keeps what it derives once and reuses: converted models, the compiled
kernel libraries. `PROBITY_CACHE_DIR`, else `$XDG_CACHE_HOME/probity`,
else `~/.cache/probity`."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(part: str) -> Path:
    base = os.environ.get("PROBITY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "probity")
    return Path(base) / part
