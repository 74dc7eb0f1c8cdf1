"""The engine's flags, declared once: `probity serve` offers them (and checks them before it
starts anything), passes them to the engine child as arguments, and each backend's child
reads them back with the same parser."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


PROBITY_ONLY = ("kept_keys_gib", "heap_keep_gib", "grammar_cache_mib", "max_distribution_floats")


@dataclass(frozen=True)
class EngineFlags:
    max_running: int = 64          # sequences run at once
    step_tokens: int = 512         # token rows in one forward pass
    kv_cache_gib: float = 2.0      # the KV block pool
    prefix_cache: bool = True
    threads: int | None = None     # torch threads (None: every core)
    kept_keys_gib: float = 1.0     # probity's engine: one decode group's gathered keys, kept between steps
    heap_keep_gib: float = 1.0     # probity's engine: free heap kept mapped (glibc's trim threshold)
    grammar_cache_mib: float = 256.0  # probity's engine: compiled grammars kept, by their measured memory
    max_distribution_floats: int = 1 << 23  # probity's engine: distribution floats (rows x vocabulary) one request may ask for

    HELP = {
        "max_running": "sequences the engine runs at once",
        "step_tokens": "token rows in one forward pass: decodes plus prompt chunks (bounds step memory)",
        "kv_cache_gib": "size of the preallocated KV block pool in GiB (the context window is capped to it)",
        # "%(default).0s" prints nothing: it only keeps the help formatter from adding a default
        "prefix_cache": "compute every prompt from scratch (the cache changes no number, only speed)%(default).0s",
        "threads": "torch threads in the engine (default: every core)%(default).0s",
        "kept_keys_gib": "the largest decode group's gathered keys kept between steps, at most (scratch; 0: none)",
        "heap_keep_gib": "free heap the engine keeps mapped instead of returning it to the OS (glibc's trim "
                         "threshold; a step's temporaries reuse it instead of faulting pages in again)",
        "grammar_cache_mib": "memory the engine's compiled grammars may hold, as measured when each was compiled "
                             "(least recently used dropped first)",
        "max_distribution_floats": "whole-distribution floats (positions x vocabulary) one request may ask for "
                                   "(`distribution: true`; 0: none)",
    }

    def problem(self) -> str | None:
        """What is wrong with these values, or None."""
        if self.max_running < 1 or self.step_tokens < 1:
            return "--max-running and --step-tokens must be at least 1"
        if not self.kv_cache_gib > 0:
            return "--kv-cache-gib must be above 0"
        if self.kept_keys_gib < 0 or self.heap_keep_gib < 0 or self.grammar_cache_mib < 0:
            return "--kept-keys-gib, --heap-keep-gib and --grammar-cache-mib must be at least 0"
        if self.max_distribution_floats < 0:
            return "--max-distribution-floats must be at least 0"
        if self.threads is not None and self.threads < 1:
            return "--threads must be at least 1"
        return None

    def argv(self, memory_knobs: bool = True) -> list[str]:
        """The child's arguments: every flag that differs from its default (the vLLM backend
        has no use for probity's own memory knobs)."""
        out: list[str] = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v == f.default or (not memory_knobs and f.name in PROBITY_ONLY):
                continue
            if f.name == "prefix_cache":
                out.append("--no-prefix-cache")
            else:
                out += [f"--{f.name.replace('_', '-')}", str(v)]
        return out

    @classmethod
    def add_to(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            name = f"--{f.name.replace('_', '-')}"
            if f.name == "prefix_cache":
                parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                                    help=cls.HELP[f.name])
            else:
                kind = int if f.name in ("max_running", "step_tokens", "threads", "max_distribution_floats") else float
                parser.add_argument(name, type=kind, default=f.default, help=cls.HELP[f.name])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineFlags":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
