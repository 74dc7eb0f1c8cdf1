"""Compiling and loading the kernels: once per source, flags and constants, into the cache
directory (`make setup` does it ahead of time), with every C function's signature declared
by name here. Two builds of one set of functions: the vector build (kernels.c, stored.c,
numerics.c; AVX2 + FMA, with AVX-512 code it runs where the CPU and PROBITY_ISA allow) and the
portable build (portable.c, numerics.c; plain x86-64), which PROBITY_ISA=generic and CPUs
without AVX2/FMA/F16C load. Both give the same bits (docs/engine.md).

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

# build -> (its sources, its flags)
BUILDS = {
    "vector": (("kernels.c", "stored.c", "numerics.c"),
               ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")),
    "portable": (("portable.c", "numerics.c"), ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")),
}
REQUIRES = ("avx2", "fma", "f16c")   # CPU flags the vector build needs

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
    "probity_exp": (("x", _p), ("y", _p), ("n", _i)),
    "probity_silu_mul": (("gu", _p), ("ld", _i), ("out", _p), ("T", _i), ("I", _i)),
    "probity_log_softmax": (("x", _p), ("ldx", _i), ("y", _p), ("ldy", _i), ("R", _i), ("V", _i)),
    "probity_cos_sin": (("a", _p), ("c", _p), ("s", _p), ("n", _i)),
    "probity_rotate": (("x", _p), ("ldx", _i), ("cos", _p), ("sin", _p), ("out", _p), ("T", _i), ("heads", _i),
                       ("hd", _i)),
    "probity_kv_store": (("k", _p), ("ldk", _i), ("v", _p), ("ldv", _i), ("rows", _p), ("n", _i), ("KV", _i),
                         ("hd", _i), ("slots", _p), ("kdst", _p), ("kstride", _i), ("vdst", _p), ("vstride", _i)),
    "probity_expand": (("type", _c), ("packed", _p), ("N", _i), ("K", _i), ("out", _p)),
    "probity_expand_rows": (("type", _c), ("packed", _p), ("K", _i), ("ids", _p), ("n", _i), ("out", _p)),
    "probity_linear_stored": (("type", _c), ("x", _p), ("ldx", _i), ("M", _i), ("packed", _p), ("N", _i), ("K", _i),
                              ("kb", _i), ("bias", _p), ("res", _p), ("ldr", _i), ("y", _p), ("ldy", _i)),
}
# what the portable build lacks (the engine does not call them there)
VECTOR_ONLY = ("probity_decode_scores", "probity_decode_values", "probity_expand", "probity_expand_rows",
               "probity_linear_stored")


def _cpu_has(*flags: str) -> bool:
    have = cpu_flags()
    return all(f in have for f in flags)


def which() -> str:
    """The build this process loads: portable under PROBITY_ISA=generic or on a CPU the vector
    build cannot run on."""
    if os.environ.get("PROBITY_ISA") == "generic" or not _cpu_has(*REQUIRES):
        return "portable"
    return "vector"


def _sources(kind: str) -> list[Path]:
    return [Path(__file__).with_name(n) for n in BUILDS[kind][0]]


def compile_flags(constants: dict[str, int], kind: str = "vector") -> list[str]:
    return [*BUILDS[kind][1], *(f"-D{k}={v}" for k, v in sorted(constants.items()))]


def library_path(constants: dict[str, int], kind: str | None = None) -> Path:
    kind = kind or which()
    tag = hashlib.sha256(b"".join(p.read_bytes() for p in _sources(kind))
                         + " ".join(compile_flags(constants, kind)).encode()).hexdigest()[:16]
    return cache_dir("kernels") / f"kernels-{kind}-{tag}.so"


def build(constants: dict[str, int], kind: str | None = None) -> Path:
    """Compile a build unless these sources with these flags were compiled before (atomic: a
    parallel build of the same file cannot leave a torn library)."""
    kind = kind or which()
    out = library_path(constants, kind)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(["gcc", *compile_flags(constants, kind), "-o", tmp, *map(str, _sources(kind)), "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(constants: dict[str, int]) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), or (None, why it is not there)."""
    kind = which()
    try:
        lib = ctypes.CDLL(str(build(constants, kind)))
    except subprocess.CalledProcessError as e:
        return None, f"gcc failed: {e.stderr.strip()[-300:]}"
    except FileNotFoundError as e:
        return None, "no gcc to compile it" if e.filename == "gcc" else f"cannot build it: {e}"
    except OSError as e:   # an unwritable cache directory, a library that will not load
        return None, f"cannot build or load it: {e}"
    for name, params in SIGNATURES.items():
        if kind == "portable" and name in VECTOR_ONLY:
            continue
        fn = getattr(lib, name)
        fn.argtypes = [t for _, t in params]
        fn.restype = None
    lib.probity_group_bytes.argtypes = [_c]
    lib.probity_group_bytes.restype = ctypes.c_int64
    lib.probity_stored_wide.argtypes = []
    lib.probity_stored_wide.restype = ctypes.c_int
    lib.probity_cpu_avx512.argtypes = []
    lib.probity_cpu_avx512.restype = ctypes.c_int
    lib.probity_exp1.argtypes = [_f]
    lib.probity_exp1.restype = _f
    lib.portable = kind == "portable"
    return lib, None
