"""The instruction-set path the engine computes on: `PROBITY_ISA=avx512|avx2|generic`, or this
CPU's best where it is not set. A path fixes what every library under the engine may use --
torch's own vectorized ops (ATEN_CPU_CAPABILITY), oneDNN's linears (ONEDNN_MAX_CPU_ISA),
MKL's GEMMs (MKL_ENABLE_INSTRUCTIONS) and probity's kernels (their AVX-512 code, or none) --
so an AVX-512 machine runs exactly what an AVX2-only one would, and naming a path this CPU
cannot run is a startup error that names it (never SIGILL).

The variables are set in the engine child before torch is imported (engine/__main__.py);
docs/engine.md, Instruction-set paths."""
from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "PROBITY_ISA"
# path -> (the CPU flags it needs, the libraries' settings that hold them to it)
PATHS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"),
               {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                "MKL_ENABLE_INSTRUCTIONS": "AVX512"}),
    "avx2": (("avx2", "fma", "f16c"),
             {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    "generic": ((), {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                     "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}),
}


class IsaError(ValueError):
    pass


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def runnable(flags: set[str]) -> list[str]:
    """The paths a CPU with these flags runs, widest first."""
    return [p for p, (needs, _) in PATHS.items() if all(f in flags for f in needs)]


def native(flags: set[str]) -> str:
    return runnable(flags)[0]


def chosen(value: str | None = None, flags: set[str] | None = None) -> str:
    """The path `value` (default: $PROBITY_ISA) names, or this CPU's own; IsaError naming it
    where it is not a path or this CPU cannot run it."""
    value = os.environ.get(VARIABLE) if value is None else value
    flags = cpu_flags() if flags is None else flags
    if not value:
        return native(flags)
    if value not in PATHS:
        raise IsaError(f"{VARIABLE}={value} is not a path: one of {', '.join(PATHS)}")
    missing = [f for f in PATHS[value][0] if f not in flags]
    if missing:
        raise IsaError(f"{VARIABLE}={value}: this CPU cannot run that path (it lacks {', '.join(missing)}); "
                       f"it runs {', '.join(runnable(flags))}")
    return value


TORCH_CAPABILITY = {"avx512": "AVX512", "avx2": "AVX2", "generic": "DEFAULT"}   # what torch then reports


def check_held(path: str) -> None:
    """IsaError unless torch reports the capability `path` holds it to (torch reads
    ATEN_CPU_CAPABILITY once, when it is imported: set after that, it holds nothing)."""
    import torch
    got = torch.backends.cpu.get_cpu_capability()
    if got != TORCH_CAPABILITY[path]:
        raise IsaError(f"{VARIABLE}={path}: torch runs its {got} kernels, not {TORCH_CAPABILITY[path]} "
                       "(was torch imported before the path was applied?)")


def apply() -> str:
    """Hold this process's libraries to the chosen path (before torch is imported); its name."""
    path = chosen()
    os.environ[VARIABLE] = path          # probity's kernels read it too (kernels.c, build.py)
    os.environ.update(PATHS[path][1])
    return path
