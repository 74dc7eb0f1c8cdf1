"""The startup calibration: every probe the engine runs before it serves, in one step, with one
result that the runner reads and the log prints.

A GEMM kernel's reduction order is an implementation detail that may change with the row
count and the CPU, and probity's own kernels claim to reproduce the libraries' orders. Here
each claim is measured on this machine, on random data made as the model makes it:
- each linear shape's oneDNN row floor (narrower calls are padded) and the k-block with which
  the linear kernel gives oneDNN's bits (`probe_linear`);
- attention's row floor for its two sliced GEMMs (`attention_min_rows`);
- whether the fused decode attention gives the general path's bits (`probe_decode_attention`).

What these measure depends only on the CPU, the kernels and the shapes, never on the weights,
so the linear and attention results are stored under a key of everything they depend on: the
CPU's model name and flags, torch's version and build configuration (its MKL and oneDNN), the
thread count, the compiled kernel library, and the source of the probes and kernels. A restart
reads them back and re-verifies each on fresh data (the floor's own count and the kernel at
1, 7 and 32 rows, and at the wide call's own count where it serves wide calls, against a wide
call) instead of the full sweep; an entry that fails is
measured again and the file rewritten. The fused decode probe is cheap and always runs.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import kernels
from .attention import KEY_ALIGN, AttnGroup, attend, masks
from .cache_dir import cache_dir
from .linear import Linear

FORMAT = 2
LINEAR_PROBE = (*range(1, 18), 24, 32, 48, 64, 96, 128, 256)   # row counts probe_linear compares
LINEAR_PROBE_WIDE = 512   # ... with the same rows of a call this wide
BLOCK_CANDIDATES = (None, 1024, 512, 256, 2048, 768, 384, 128)   # the kernel's k-blocks tried (None: one chain over K)
KERNEL_PROBE_ROWS = (1, 2, 3, 5, 6, 7, 12, 13, 31, 32)
VERIFY_WIDE = 64          # rows of the wide call a cached linear entry is checked against (in LINEAR_PROBE)
VERIFY_NARROW = (1, 7, 32)
SOURCES = ("kernels/kernels.c", "kernels/stored.c", "kernels/__init__.py", "kernels/build.py", "linear.py", "attention.py",
           "calibration.py")


# ---------------------------------------------------------------- the probes

def probe_linear(lin: Linear) -> tuple[int, int | None]:
    """(floor, kb) for calls of `lin` on this CPU, from one wide oneDNN call on random data
    made as the model makes it (with or without the fused add).

    floor: the fewest rows a oneDNN call may have. Every row of a call with a count in
    LINEAR_PROBE is compared bit for bit with the same row of the LINEAR_PROBE_WIDE-row call,
    and the smallest probed count from which every larger one agrees is returned (never a count
    between two probed ones, which nothing showed to agree).

    kb: the k-block with which the linear kernel gives the wide call's bits for every count in
    KERNEL_PROBE_ROWS, or None (no candidate does, or there is no kernel here): then oneDNN
    serves every call of this shape.

    A kernel's choice depends on the shapes, not on the values, so one probe serves every
    layer of a shape."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(LINEAR_PROBE_WIDE, lin.in_features, generator=gen)
    r = torch.randn(LINEAR_PROBE_WIDE, lin.out_features, generator=gen) if lin.residual else None
    wide = lin.gemm(x, r)
    bad = 0
    for m in LINEAR_PROBE:
        if not torch.equal(lin.gemm(x[:m], _rows(r, m)), wide[:m]):
            bad = m
    kb = None
    if lin.has_kernel:
        k = lin.in_features
        for cand in BLOCK_CANDIDATES:
            if cand is not None and cand >= k:
                continue   # the same order as one chain, tried first
            block = k if cand is None else cand
            if all(torch.equal(lin.narrow(x[:m], block, _rows(r, m)), wide[:m]) for m in _kernel_rows(lin)):
                kb = block
                break
    return next((m for m in LINEAR_PROBE if m > bad), LINEAR_PROBE_WIDE), kb


def _kernel_rows(lin: Linear) -> tuple[int, ...]:
    """The row counts the kernel is compared at: the narrow ones, and for a kernel that serves
    every count (Linear.wide) a wide call too."""
    return (*KERNEL_PROBE_ROWS, 100, LINEAR_PROBE_WIDE) if lin.wide else KERNEL_PROBE_ROWS


def _rows(t: torch.Tensor | None, m: int) -> torch.Tensor | None:
    return None if t is None else t[:m]


def attention_min_rows(head_dim: int, group: int, row_counts: list[int], probe_columns: int = 4096,
                       seed: int = 0) -> int:
    """The fewest query rows per item that attention may give its two GEMMs on this CPU.

    A GEMM kernel may reduce a row differently when the call has few rows (an AMD EPYC's MKL
    gave rows 1-3 of both sliced GEMMs other bits than from 4 on). So for every per-item row
    count the runner can use (`row_counts`, ascending; grouped-query heads make `group` GEMM
    rows of each), both GEMMs are run on random data and every row compared bit for bit with
    the same row of the widest call. Returned: the smallest count from which every larger one
    agrees. Counts whose GEMM width is past `probe_columns` are checked at powers of two and at
    the widest (a kernel's choice below such widths is what varies; above it the reduction
    over head_dim does not)."""
    widest = row_counts[-1]
    probed = [r for r in row_counts
              if r * group <= probe_columns or r & (r - 1) == 0 or r == widest]
    gen = torch.Generator().manual_seed(seed)
    bad = 0
    for L, items in ((KEY_ALIGN, 1), (3 * KEY_ALIGN, 3)):
        keys = torch.randn(2, items, L, head_dim, generator=gen)
        vals = torch.randn(2, items, L, head_dim + 1, generator=gen)
        qs = torch.randn(2, items, widest * group, head_dim, generator=gen)
        e = torch.rand(2, items, L // KEY_ALIGN, widest * group, KEY_ALIGN, generator=gen)
        s_ref, v_ref = kernels.score_gemm(keys, qs), kernels.value_gemm(e, vals)
        for r in probed[:-1]:
            c = r * group
            if not (torch.equal(kernels.score_gemm(keys, qs[:, :, :c]), s_ref[..., :c, :])
                    and torch.equal(kernels.value_gemm(e[..., :c, :].contiguous(), vals), v_ref[..., :c, :])):
                bad = max(bad, r)
    return next(r for r in row_counts if r > bad)


def probe_decode_attention(head_dim: int, n_kv: int, group: int, seed: int = 0) -> str | None:
    """None if the fused decode attention gives the general path's bits for decode groups of
    this shape (items of one row, keys visible to all of them or not, several key lengths),
    else why not."""
    if kernels.lib() is None:
        return f"no kernel ({kernels.why_not()})"
    if head_dim not in kernels.HEAD_DIMS or group > kernels.GROUP_MAX:
        return f"head dim {head_dim} / group {group} outside the kernel's range"
    gen = torch.Generator().manual_seed(seed)
    for positions in ((5, 70, 190), (130, 150, 191), (0, 63, 64)):
        fused, general = decode_both_ways(head_dim, n_kv, group, positions, 3 * KEY_ALIGN, 3.0, gen)
        if not torch.equal(fused, general):
            return "it does not give the general path's bits on this CPU"
    return None


def decode_both_ways(head_dim: int, n_kv: int, group: int, positions, length: int, q_scale: float,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode group on random data (one item per position in `positions`, `length` keys each,
    queries scaled by `q_scale`), attended by the fused kernel and by the general path."""
    items, L = len(positions), length
    q = torch.randn(items, n_kv * group, head_dim, generator=gen) * q_scale
    keys = torch.randn(n_kv, items, L, head_dim, generator=gen)
    vals = torch.cat([torch.randn(n_kv, items, L, head_dim, generator=gen), torch.ones(n_kv, items, L, 1)], -1)
    lead = min(positions) // KEY_ALIGN * KEY_ALIGN
    visible, hide = masks(lead, L, [[p] for p in positions])
    g = AttnGroup(items=items, rows=1, nb=0, length=L, idx=torch.arange(items), dest=torch.arange(items),
                  keep=None, lead=lead, visible=visible, hide=hide, blocks=torch.zeros(0, dtype=torch.long),
                  qpos=torch.tensor([[p] for p in positions]), decode=True, pos=torch.tensor(positions))
    scale = head_dim ** -0.5
    return (attend(q, keys, vals, g, scale, fused_decode=True), attend(q, keys, vals, g, scale, fused_decode=False))


# ---------------------------------------------------------------- the step

@dataclass
class Calibrated:
    """What the startup calibration found: the runner and model read it, the log prints it."""
    linears: dict[tuple, tuple[int, int | None]]   # Linear.shape_key -> (oneDNN floor, kernel k-block or None)
    attention_floor: int                           # query rows per attention item, at least
    fused_decode: str | None                       # None: a decode group's attention runs fused; else why not
    cache: str = ""                                # what the cache did
    lines: list[str] = field(default_factory=list)

    def describe(self) -> list[str]:
        floors = sorted({f for f, _ in self.linears.values()})
        fast = sum(kb is not None for _, kb in self.linears.values())
        kern = (f"equals oneDNN on {fast} of {len(self.linears)} linear shapes" if kernels.lib() is not None
                else f"not used: {kernels.why_not()}")
        return [self.cache,
                f"row floors on this CPU: attention {self.attention_floor} per sequence, "
                f"linears {'/'.join(map(str, floors))}",
                f"linear kernel (calls of up to {kernels.MAX_ROWS} rows"
                f"{'; stored weights: every call' if kernels.stored_wide() else ''}): {kern}",
                "fused decode attention: " + ("used" if self.fused_decode is None else f"not used: {self.fused_decode}")]


def calibrate(model, row_counts: list[int], cache: "Calibration | None" = None) -> Calibrated:
    """Run every probe for `model` (or read it back from the cache, verified), apply what was
    found to the model's linears and attention, and return it."""
    cache = cache if cache is not None else Calibration.default()
    linears: dict[tuple, tuple[int, int | None]] = {}
    for lin in model.linears():
        if lin.shape_key not in linears:
            linears[lin.shape_key] = cache.linear(lin)
        lin.calibrated(*linears[lin.shape_key])
    floor = cache.attention(model.head_dim, model.group, row_counts)
    fused = (probe_decode_attention(model.head_dim, model.n_kv, model.group) if floor == 1
             else f"attention's floor is {floor} rows per item")
    model.fused_decode = fused is None
    cache.save()
    return Calibrated(linears, floor, fused, cache.summary())


# ---------------------------------------------------------------- the cache

def _sources() -> bytes:
    here = Path(__file__).parent
    return b"".join((here / f).read_bytes() for f in SOURCES)


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
    return {
        "format": FORMAT, "cpu": model, "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "torch_config": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(), "isa": os.environ.get("PROBITY_ISA", ""),
        "aten": torch.backends.cpu.get_cpu_capability(),
        "kernels": kernels.library_path().name if kernels.lib() is not None else f"none: {kernels.why_not()}",
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

    def linear(self, lin: Linear) -> tuple[int, int | None]:
        """(floor, kb) of this linear's shape and kind of call (see probe_linear)."""
        t0 = time.monotonic()
        out_f, in_f, bias, residual, stored = lin.shape_key
        key = f"linear/{out_f}x{in_f}/bias={bias}/residual={residual}" + ("/stored" if stored else "")
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


def _verify_linear(lin: Linear, floor: object, kb: object) -> bool:
    """A cached (floor, kb) still gives a wide call's bits on fresh data: oneDNN at the floor's
    count, the kernel at VERIFY_NARROW rows."""
    if type(floor) is not int or floor < 1 or not (kb is None or type(kb) is int):
        return False
    if kb is not None and not lin.has_kernel:
        return False  # the kernel is not here after all
    gen = torch.Generator().manual_seed(1)
    wide_rows = max(VERIFY_WIDE, floor)
    x = torch.randn(wide_rows, lin.in_features, generator=gen)
    r = torch.randn(wide_rows, lin.out_features, generator=gen) if lin.residual else None
    wide = lin.gemm(x, r)
    if not torch.equal(lin.gemm(x[:floor], _rows(r, floor)), wide[:floor]):
        return False
    if kb is not None:
        for m in (*VERIFY_NARROW, wide_rows) if lin.wide else VERIFY_NARROW:
            if not torch.equal(lin.narrow(x[:m], kb, _rows(r, m)), wide[:m]):
                return False
    return True
