"""Tiny random-weight Llama models written as GGUF files in any type probity keeps as stored,
with the tests' real BPE tokenizer in the file's metadata (as llama.cpp writes a `gpt2`-style
vocabulary). gguf-py quantizes where it has a quantizer (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16,
BF16); the K-quants' blocks are written directly, random but of a realistic spread, since gguf-py
has only their de-quantizers (which the tests then hold probity's expansion against)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of what its readers undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks [n, k/256 * bytes]: quantized values and 6-bit scales at random,
    float16 scales chosen so the weights spread over about +-0.2."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[getattr(GGMLQuantizationType, kind)]
    nb = n * k // 256
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    if kind == "Q6_K":
        b[:, 192:208] = rng.integers(-40, 40, size=(nb, 16)).astype(np.int8).view(np.uint8)
        b[:, 208:210] = np.full(nb, 0.2 / (40 * 32), np.float16).view(np.uint8).reshape(nb, 2)
    else:
        scale = 0.2 / (63 * (15 if kind == "Q4_K" else 31))
        b[:, 0:2] = (rng.random(nb) * 2 * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
        b[:, 2:4] = (rng.random(nb) * scale * 8).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return b.reshape(n, -1)


def write_tiny_gguf(path: Path, kind: str, tokenizer_dir: Path, hidden: int = 64, seed: int = 0) -> Path:
    """A 2-layer Llama of `hidden` width whose 2-D weights are all of `kind` (K-quants need
    hidden a multiple of 256), norms float32, the tokenizer from `tokenizer_dir`."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    cfg = json.loads((tokenizer_dir / "config.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [added.get(i, s) for s, i in vocab]
    n_vocab = len(tokens)
    heads, kv_heads, inter = 4, 2, 2 * hidden
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(2)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(n_vocab)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    chat = json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if chat is None and (tokenizer_dir / "chat_template.jinja").exists():
        chat = (tokenizer_dir / "chat_template.jinja").read_text()
    if chat:
        w.add_chat_template(chat)
    qtype = getattr(GGMLQuantizationType, kind)

    def matrix(name: str, n: int, k: int, permute: int = 0) -> None:
        if kind in K_QUANTS:
            data = _k_blocks(kind, n, k, rng)
            w.add_tensor(name, data, raw_dtype=qtype)   # the shape is derived from the bytes
            return
        x = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)
        if permute:
            x = _permute(x, permute)
        if kind == "F32":
            w.add_tensor(name, x)
        elif kind == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)

    def vector(name: str, n: int) -> None:
        w.add_tensor(name, (1 + rng.standard_normal(n) * 0.1).astype(np.float32))

    hd = hidden // heads
    matrix("token_embd.weight", n_vocab, hidden)
    vector("output_norm.weight", hidden)
    matrix("output.weight", n_vocab, hidden)
    for i in range(2):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden)
        vector(p + "ffn_norm.weight", hidden)
        matrix(p + "attn_q.weight", heads * hd, hidden, permute=heads)
        matrix(p + "attn_k.weight", kv_heads * hd, hidden, permute=kv_heads)
        matrix(p + "attn_v.weight", kv_heads * hd, hidden)
        matrix(p + "attn_output.weight", hidden, heads * hd)
        matrix(p + "ffn_gate.weight", inter, hidden)
        matrix(p + "ffn_up.weight", inter, hidden)
        matrix(p + "ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_model(path: Path):
    """The file's model in float32, every weight de-quantized by gguf-py (and the q/k rows put
    back in transformers' order), in transformers' own Llama."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM

    from probity.engine.checkpoint import gguf_config

    config = gguf_config(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    state = {}
    for t in GGUFReader(str(path)).tensors:
        stem, leaf = t.name.rsplit(".", 1)
        shape = tuple(reversed(t.shape.tolist()))
        w = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if stem.startswith("blk."):
            _, i, sub = stem.split(".", 2)
            name = f"model.layers.{i}.{layer[sub]}.{leaf}"
            if sub in ("attn_q", "attn_k"):
                n_head = config.num_attention_heads if sub == "attn_q" else config.num_key_value_heads
                dim = w.shape[0] // n_head // 2
                w = w.reshape(n_head, dim, 2, -1).swapaxes(2, 1).reshape(shape)
        else:
            name = f"{names[stem]}.{leaf}"
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    model.load_state_dict(state, strict=False)
    return model
