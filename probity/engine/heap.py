"""The engine's heap, through glibc: how much freed memory it keeps mapped, handing it back,
and how much is in use (the grammar cache counts a compile by it). Glibc only; elsewhere the
tuning does nothing and the in-use figure is the resident set."""
from __future__ import annotations

import ctypes
import functools


def keep_freed_memory(keep_bytes: int = 1 << 30) -> None:
    """glibc hands large freed blocks back to the kernel (munmap, heap trimming) and maps them
    anew for the next allocation, so a step's temporaries (MBs each) fault their pages in again
    every step, and how often depends on the allocation history: the same workload ran 8%
    slower in one engine than in another. Allocations below 32 MiB come from the heap, and
    the heap is not trimmed below `keep_bytes` of free space (--heap-keep-gib). Glibc only;
    elsewhere nothing changes."""
    libc = _glibc()
    if libc is None:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, min(keep_bytes, 2**31 - 1))


def release_freed_memory() -> None:
    """Hand the heap's free space back to the kernel once (glibc's malloc_trim), after loading:
    packing a checkpoint's blocks and the startup probes leave GBs of freed temporaries in the heap
    that keep_freed_memory's threshold would otherwise keep for good (a 7B Q4_K engine was
    resident in 8.6 GiB for 4.3 GiB of weights, 4.8 after this). Steps then grow the heap
    again up to what they use."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _glibc():
    """glibc through ctypes, or None where the C library is another (its malloc tuning is
    glibc's own)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    if hasattr(libc, "mallinfo2"):   # glibc 2.33 on
        libc.mallinfo2.restype = _Mallinfo2
    return libc


def heap_in_use() -> int:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: heap plus mmapped
    chunks), whatever is kept mapped; the resident set where the C library is another."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
