"""Compiling and loading kernels.c and stored.c: once per source, flags and constants, into the cache
directory (`make setup` does it ahead of time), with every C function's signature declared
by name here.

The library links libgomp.so.1, so loaded after torch it resolves to torch's own OpenMP
runtime: one thread pool, sized by torch.set_num_threads."""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from ..isa import cpu_flags
from ..cache_dir import cache_dir

SOURCES = [Path(__file__).with_name(n) for n in ("kernels.c", "stored.c")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
REQUIRES = ("avx2", "fma", "f16c")   # CPU flags the code needs

_p, _i, _f, _c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# name -> its parameters in order, (name, ctype): the Python wrappers (kernels/__init__.py)
# pass them in this order.
SIGNATURES: dict[str, tuple[tuple[str, object], ...]] = {
    "probity_linear": (("x", _p), ("ldx", _i), ("M", _i), ("packed", _p), ("N", _i), ("K", _i), ("kb", _i),
                       ("bias", _p), ("res", _p), ("ldr", _i), ("y", _p), ("ldy", _i)),
    "probity_score": (("q", _p), ("keys", _p), ("out", _p), ("B", _i), ("S", _i), ("C", _i), ("hd", _i)),
    "probity_value": (("e", _p), ("vals", _p), ("out", _p), ("B", _i), ("S", _i), ("C", _i), ("W", _i)),
    "probity_decode_scores": (("q", _p), ("row", _p), ("keys", _p), ("pos", _p), ("out", _p), ("KV", _i),
                              ("items", _i), ("G", _i), ("L", _i), ("hd", _i), ("scale", _f), ("lead", _i),
                              ("floor", _f)),
    "probity_decode_values": (("e", _p), ("vals", _p), ("pos", _p), ("part", _p), ("out", _p), ("KV", _i),
                              ("items", _i), ("G", _i), ("L", _i), ("hd", _i), ("lead", _i)),
    "probity_rms_norm": (("x", _p), ("w", _p), ("y", _p), ("T", _i), ("D", _i), ("eps", _f)),
    "probity_rotate": (("x", _p), ("ldx", _i), ("cos", _p), ("sin", _p), ("out", _p), ("T", _i), ("heads", _i),
                       ("hd", _i)),
    "probity_expand": (("type", _c), ("packed", _p), ("N", _i), ("K", _i), ("out", _p)),
    "probity_expand_rows": (("type", _c), ("packed", _p), ("K", _i), ("ids", _p), ("n", _i), ("out", _p)),
    "probity_linear_stored": (("type", _c), ("x", _p), ("ldx", _i), ("M", _i), ("packed", _p), ("N", _i), ("K", _i),
                              ("kb", _i), ("bias", _p), ("res", _p), ("ldr", _i), ("y", _p), ("ldy", _i)),
}



def _cpu_has(*flags: str) -> bool:
    have = cpu_flags()
    return all(f in have for f in flags)


def compile_flags(constants: dict[str, int]) -> list[str]:
    return [*FLAGS, *(f"-D{k}={v}" for k, v in sorted(constants.items()))]


def library_path(constants: dict[str, int]) -> Path:
    tag = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)
                         + " ".join(compile_flags(constants)).encode()).hexdigest()[:16]
    return cache_dir("kernels") / f"kernels-{tag}.so"


def build(constants: dict[str, int]) -> Path:
    """Compile kernels.c unless this source with these flags was compiled before (atomic: a
    parallel build of the same file cannot leave a torn library)."""
    out = library_path(constants)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(["gcc", *compile_flags(constants), "-o", tmp, *map(str, SOURCES)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(constants: dict[str, int]) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), or (None, why it is not there)."""
    if os.environ.get("PROBITY_ISA") == "generic":
        return None, "PROBITY_ISA=generic holds the engine to torch's own paths"
    if not _cpu_has(*REQUIRES):
        return None, "this CPU lacks AVX2/FMA/F16C"
    try:
        lib = ctypes.CDLL(str(build(constants)))
    except subprocess.CalledProcessError as e:
        return None, f"gcc failed: {e.stderr.strip()[-300:]}"
    except FileNotFoundError as e:
        return None, "no gcc to compile it" if e.filename == "gcc" else f"cannot build it: {e}"
    except OSError as e:   # an unwritable cache directory, a library that will not load
        return None, f"cannot build or load it: {e}"
    for name, params in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [t for _, t in params]
        fn.restype = None
    lib.probity_group_bytes.argtypes = [_c]
    lib.probity_group_bytes.restype = ctypes.c_int64
    lib.probity_stored_wide.argtypes = []
    lib.probity_stored_wide.restype = ctypes.c_int
    return lib, None
