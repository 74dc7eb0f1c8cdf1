"""PROBITY_ISA (issue 37): the engine runs on the instruction-set path it is given, with every
library held to it; a path this CPU cannot run is a startup error that names it; and every path
gives the same numbers, bit for bit, under the same system_fingerprint (a digest of what
determines the bits: the weights, the numerics version, the dtype, the numbers on a probe)."""
from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from conftest import DEFAULT_ARGS, ROOT, tiny_args
from probity.engine import isa

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village,"]


def test_a_path_is_checked_against_the_cpu():
    avx2_only = {"avx2", "fma", "f16c", "sse4_2"}
    assert isa.chosen("", avx2_only) == "avx2" and isa.chosen("", set()) == "generic"
    assert isa.chosen("generic", avx2_only) == "generic"
    with pytest.raises(isa.IsaError, match=r"PROBITY_ISA=avx512: this CPU cannot run that path \(it lacks "
                                           r"avx512f, avx512bw, avx512vl\); it runs avx2, generic"):
        isa.chosen("avx512", avx2_only)
    with pytest.raises(isa.IsaError, match="not a path: one of avx512, avx2, generic"):
        isa.chosen("sse9", avx2_only)


@pytest.mark.parametrize("value", ["sse9", *[p for p in isa.PATHS if p not in isa.runnable(isa.cpu_flags())]])
def test_serving_on_a_path_this_cpu_cannot_run_is_a_named_startup_error(tiny_model_dir, value):
    r = subprocess.run([sys.executable, "-m", "probity", "serve", *tiny_args(tiny_model_dir)], cwd=ROOT,
                       env={**__import__("os").environ, "PROBITY_ISA": value}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and f"PROBITY_ISA={value}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def bits(server, prompt: str) -> list[int]:
    r = server.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8,
                                        "temperature": 0, "echo": True, "logprobs": 5})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    values = [v for v in lp["token_logprobs"] if v is not None]
    values += [v for table in lp["top_logprobs"] if table for v in table.values()]
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def fingerprint(server) -> str:
    r = server.post("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 1})
    return r.json()["system_fingerprint"]


@pytest.mark.default_model
@pytest.mark.parametrize("path", [p for p in isa.runnable(isa.cpu_flags())[1:]])
def test_every_path_gives_the_native_numbers_under_one_fingerprint(servers, default_server, path):
    """The default model served natively and on each narrower path this CPU runs (what a CPU
    without the wider instructions runs; generic: the portable build, the GGUF expanded to
    float32): every logprob and top-table value is the same float, bit for bit, and the
    fingerprints are equal."""
    narrow = servers.get(DEFAULT_ARGS, env={"PROBITY_ISA": path}, startup=600)
    assert fingerprint(default_server) == fingerprint(narrow)
    for p in PROMPTS:
        assert bits(default_server, p) == bits(narrow, p), p
    servers.release(DEFAULT_ARGS, env={"PROBITY_ISA": path})


def test_the_fingerprint_is_the_same_on_every_start(servers, tiny_model_dir):
    a = servers.fresh(tiny_args(tiny_model_dir, "--kv-cache-gib", "0.25"))
    first = fingerprint_tiny(a)
    a.stop()
    b = servers.fresh(tiny_args(tiny_model_dir, "--kv-cache-gib", "0.25"))
    assert fingerprint_tiny(b) == first
    b.stop()


def fingerprint_tiny(server) -> str:
    r = server.post("/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1})
    return r.json()["system_fingerprint"]
