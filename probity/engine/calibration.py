"""The startup calibration, measured once per machine and reused.

What the engine measures at startup — each linear shape's oneDNN row floor and narrow.c
k-block (`model.probe_linear`), attention's row floor (`model.attention_min_rows`) — depends
only on the CPU, the kernels and the shapes, not on the weights. So it is stored on disk under
a key made of everything it depends on: the CPU's model name and flags, torch's version and
build configuration (its MKL and oneDNN versions), the thread count, the compiled kernel
library, and the source of the probes and kernels themselves. A restart (or a second
model with the same shapes) reads it back and re-verifies each entry with a few calls on
fresh data (the floor's own count and narrow.c at 1, 7 and 32 rows against a wide call)
instead of the full sweep; an entry that fails is measured again and the file rewritten.
The log says which happened.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from . import narrow
from .cache_dir import cache_dir

FORMAT = 1
VERIFY_WIDE = 64          # rows of the wide call a cached linear entry is checked against (in LINEAR_PROBE)
VERIFY_NARROW = (1, 7, 32)


def _sources() -> bytes:
    here = Path(__file__).parent
    return b"".join((here / f).read_bytes() for f in ("model.py", "narrow.py", "narrow.c", "calibration.py"))


def _cpu() -> tuple[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor is enough: every core of a machine is the same model
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    return fields.get("model name", "unknown"), fields.get("flags", "")


def fingerprint() -> dict:
    """Everything the calibration's outcome depends on, weights excepted."""
    model, flags = _cpu()
    lib = narrow.load()
    return {
        "format": FORMAT, "cpu": model, "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "torch_config": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "narrow": narrow.library_path().name if lib is not None else f"none: {narrow.why_not()}",
        "code": hashlib.sha256(_sources()).hexdigest()[:16],
    }


class Calibration:
    """The cached results for this machine; `linear` and `attention` answer from it (verified)
    or measure. `save` writes what was measured. `path=None` keeps nothing on disk."""

    def __init__(self, path: Path | None = None):
        self.fp = fingerprint()
        digest = hashlib.sha256(json.dumps(self.fp, sort_keys=True).encode()).hexdigest()[:20]
        self.path = None if path is None else path / f"{digest}.json"
        self.entries: dict[str, object] = {}
        self.reused = self.measured = self.failed = 0
        self.seconds = 0.0
        if self.path is not None:
            try:
                data = json.loads(self.path.read_text())
                if data.get("fingerprint") == self.fp:
                    self.entries = dict(data.get("entries", {}))
            except (OSError, ValueError, AttributeError):
                pass  # absent or unreadable: measured afresh and rewritten

    @classmethod
    def default(cls) -> "Calibration":
        return cls(None if os.environ.get("PROBITY_CALIBRATION") == "fresh" else cache_dir("calibration"))

    def linear(self, lin) -> tuple[int, int | None]:
        """(floor, kb) of this linear's shape and kind of call (see model.probe_linear)."""
        from .model import probe_linear

        t0 = time.monotonic()
        key = f"linear/{lin.out_features}x{lin.in_features}/bias={lin.b is not None}/residual={lin.residual}"
        got = self.entries.get(key)
        if isinstance(got, list) and len(got) == 2 and _verify_linear(lin, got[0], got[1]):
            self.reused += 1
            result = (got[0], got[1])
        else:
            self.failed += got is not None
            result = probe_linear(lin)
            self.entries[key] = list(result)
            self.measured += 1
        self.seconds += time.monotonic() - t0
        return result

    def attention(self, head_dim: int, group: int, row_counts: list[int]) -> int:
        from .model import attention_min_rows

        t0 = time.monotonic()
        key = f"attention/{head_dim}x{group}/" + hashlib.sha256(str(row_counts).encode()).hexdigest()[:12]
        got = self.entries.get(key)
        if (type(got) is int and got in row_counts
                and attention_min_rows(head_dim, group, [got, row_counts[-1]], seed=1) == got):
            self.reused += 1
            result = got
        else:
            self.failed += got is not None
            result = attention_min_rows(head_dim, group, row_counts)
            self.entries[key] = result
            self.measured += 1
        self.seconds += time.monotonic() - t0
        return result

    def save(self) -> None:
        if self.path is None or not self.measured:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"fingerprint": self.fp, "entries": self.entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass  # an unwritable cache: the next start measures again, nothing else changes

    def summary(self) -> str:
        where = "not cached" if self.path is None else str(self.path)
        if self.measured == 0:
            return f"startup calibration: {self.reused} entries from {where}, verified in {self.seconds:.2f}s"
        redone = f" ({self.failed} cached entries failed verification)" if self.failed else ""
        return (f"startup calibration: {self.measured} entries measured, {self.reused} reused, "
                f"in {self.seconds:.2f}s{redone}; kept in {where}")


def _verify_linear(lin, floor: object, kb: object) -> bool:
    """A cached (floor, kb) still gives a wide call's bits on fresh data: oneDNN at the floor's
    count, narrow.c at VERIFY_NARROW rows."""
    if type(floor) is not int or floor < 1 or not (kb is None or type(kb) is int):
        return False
    if kb is not None and lin.packed is None:
        return False  # the kernel is not here after all
    gen = torch.Generator().manual_seed(1)
    wide_rows = max(VERIFY_WIDE, floor)
    x = torch.randn(wide_rows, lin.in_features, generator=gen)
    r = torch.randn(wide_rows, lin.out_features, generator=gen) if lin.residual else None
    wide = lin.gemm(x, r)

    def rows(t, m):
        return None if t is None else t[:m]
    if not torch.equal(lin.gemm(x[:floor], rows(r, floor)), wide[:floor]):
        return False
    if kb is not None:
        for m in VERIFY_NARROW:
            if not torch.equal(narrow.linear(x[:m], lin.packed, lin.out_features, kb, lin.b, rows(r, m)), wide[:m]):
                return False
    return True
