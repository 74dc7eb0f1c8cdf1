"""7B-class models as stored, on this machine: a Llama-shaped random-weight checkpoint of the
real dimensions (Llama-2-7B: hidden 4096, 32 layers, 32 heads, FFN 11008, vocab 32000) written
as bf16 safetensors (~13.5 GB) and as a Q4_K GGUF (~4 GB), each served by probity; reported:
load time (process start to /health ok), the engine's memory by part, the 16-token prompt's
prefill time and single-stream decode tokens/s (from a streamed response's token times).

    .venv/bin/python bench/bench_big.py [--dir /var/tmp/probity-big] [--only bf16,q4k] [--tokens 32]

The weights are random (no such model can be downloaded here): bf16 ones drawn N(0, 0.02);
the Q4_K file's blocks are random quantized values under float16 scales of the same spread
(gguf-py has no Q4_K quantizer; its de-quantizer is what probity's expansion is tested
against). The tokenizer is the default model's (a vocabulary of 49,152 fitted into 32,000
ids would not tokenize; the bench sends token ids)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

DIMS = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)


def tokenizer_dir(out: Path) -> Path:
    """The default model's tokenizer, saved as files (its ids above 32,000 are never sent)."""
    from transformers import PreTrainedTokenizerFast

    from probity.engine.loader import default_model_path

    p = default_model_path()
    tok = PreTrainedTokenizerFast.from_pretrained(str(p.parent), gguf_file=p.name)
    d = out / "tokenizer"
    tok.save_pretrained(d)
    return d


def write_bf16(out: Path) -> Path:
    """Llama-2-7B-shaped bf16 safetensors, written shard by shard (never the whole model in memory)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder = out / "llama7b-bf16"
    if (folder / "model.safetensors.index.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**DIMS, tie_word_embeddings=False, torch_dtype="bfloat16")
    cfg.save_pretrained(folder)
    for f in tokenizer_dir(out).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    gen = torch.Generator().manual_seed(0)
    h, i, L, V = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["num_hidden_layers"], DIMS["vocab_size"]

    def mat(n, k):
        return (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)

    index, shard = {}, 0

    def flush(tensors):
        nonlocal shard
        name = f"model-{shard:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        index.update({k: name for k in tensors})
        shard += 1

    flush({"model.embed_tokens.weight": mat(V, h), "lm_head.weight": mat(V, h),
           "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for li in range(L):
        p = f"model.layers.{li}."
        flush({p + "self_attn.q_proj.weight": mat(h, h), p + "self_attn.k_proj.weight": mat(h, h),
               p + "self_attn.v_proj.weight": mat(h, h), p + "self_attn.o_proj.weight": mat(h, h),
               p + "mlp.gate_proj.weight": mat(i, h), p + "mlp.up_proj.weight": mat(i, h),
               p + "mlp.down_proj.weight": mat(h, i),
               p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return folder


def write_q4k(out: Path) -> Path:
    """Llama-2-7B-shaped Q4_K GGUF (norms F32, the head Q6_K as llama.cpp's Q4_K_M files have it)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from tiny_gguf import _k_blocks

    path = out / "llama7b-Q4_K.gguf"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    h, i, L, V = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["num_hidden_layers"], DIMS["vocab_size"]
    rng = np.random.default_rng(0)
    tok = json.loads((tokenizer_dir(out) / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])[:V]
    w = GGUFWriter(str(path), "llama", use_temp_file=True)
    w.add_name("llama7b-random")
    w.add_context_length(DIMS["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(L)
    w.add_feed_forward_length(i)
    w.add_head_count(DIMS["num_attention_heads"])
    w.add_head_count_kv(DIMS["num_key_value_heads"])
    w.add_rope_dimension_count(h // DIMS["num_attention_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(DIMS["rms_norm_eps"])
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([s for s, _ in vocab])
    w.add_token_types([1] * V)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]
                        if all(x in tok["model"]["vocab"] and tok["model"]["vocab"][x] < V
                               for x in (m.split(" ") if isinstance(m, str) else m))][:20000])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def q(name, n, k, kind="Q4_K"):
        w.add_tensor(name, _k_blocks(kind, n, k, rng), raw_dtype=getattr(GGMLQuantizationType, kind))

    q("token_embd.weight", V, h)
    q("output.weight", V, h, "Q6_K")
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for li in range(L):
        p = f"blk.{li}."
        for name, n, k in (("attn_q", h, h), ("attn_k", h, h), ("attn_v", h, h), ("attn_output", h, h),
                           ("ffn_gate", i, h), ("ffn_up", i, h), ("ffn_down", h, i)):
            q(p + name + ".weight", n, k)
        w.add_tensor(p + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def serve_and_measure(model: Path, label: str, tokens: int) -> dict:
    from conftest import LiveServer

    t0 = time.monotonic()
    s = LiveServer(["--model", str(model), "--threads", str(os.cpu_count()), "--kv-cache-gib", "0.5",
                    "--max-running", "4"], startup=1800)
    load_s = time.monotonic() - t0
    try:
        mid = s.get("/v1/models").json()["data"][0]["id"]
        body = {"model": mid, "prompt": list(range(1000, 1016)), "max_tokens": tokens, "temperature": 0,
                "logit_bias": {"2": -100}}
        httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=3600)   # warm
        # streamed: the first token's time is the prompt's prefill, the rest one decode step each
        t = time.monotonic()
        stamps = []
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=3600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"] is not None:
                    stamps.append(time.monotonic())
        first, decode = stamps[0] - t, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
        health = s.get("/health").json()["engine"]
        return {"model": label, "file_gb": sum(f.stat().st_size for f in ([model] if model.is_file() else model.iterdir())) / 1e9,
                "load_s": load_s, "prefill_16_tokens_s": first, "decode_tokens_per_s": 1 / decode,
                "decode_step_ms": decode * 1e3, "tokens": len(stamps),
                "memory_gib": {k: v / 2**30 for k, v in health["memory"].items()},
                "resident_now_gib": health["stats"].get("resident_bytes", 0) / 2**30}
    finally:
        s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp/probity-big")
    ap.add_argument("--only", default="bf16,q4k")
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    out = Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    for kind in a.only.split(","):
        t = time.monotonic()
        model = write_bf16(out) if kind == "bf16" else write_q4k(out)
        print(f"{kind}: written in {time.monotonic() - t:.0f}s at {model}", flush=True)
        print(json.dumps(serve_and_measure(model, kind, a.tokens), indent=1), flush=True)


if __name__ == "__main__":
    main()
