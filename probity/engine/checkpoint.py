"""A checkpoint's tensors by their transformers names, as the checkpoint stores them.

`ModuleWeights` reads a loaded transformers model; `GGUFWeights` reads a GGUF file directly
(memory-mapped), so its quantized blocks are never expanded to float32 as a whole: a linear
layer's weight becomes a StoredWeight (stored.py), a norm's float32 vector stays what it is.
Either answers `get(name)` with a float tensor (any dtype) or a StoredWeight."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .stored import TYPES, StoredWeight, pack

# transformers' names -> GGUF's, for the families probity's own forward serves (llama.cpp's
# `llama`, `qwen2`, `qwen3` architectures; Mistral's checkpoints are `llama` there)
_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
STORED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


class ModuleWeights:
    """The parameters of a loaded transformers model. `consume`: each tensor is taken out of the
    model once it has been read (the engine's case: a 7B checkpoint in 16 bits and its packed
    copy would not fit side by side), so the model is left empty."""

    def __init__(self, hf_model, consume: bool = False):
        self.params = dict(hf_model.named_parameters(remove_duplicate=False))
        self.config = hf_model.config
        self.consume = consume

    def has(self, name: str) -> bool:
        return name in self.params

    def get(self, name: str) -> torch.Tensor:
        p = self.params[name]
        t = p.detach()
        if self.consume:
            if not t.numel():
                raise RuntimeError(f"{name} was read once already")
            p.data = torch.empty(0, dtype=p.dtype)   # the caller's reference is the last one
        return t


class GGUFWeights:
    """A GGUF file's tensors under transformers' names: quantized and 16-bit 2-D tensors as
    StoredWeight, everything else as float32 tensors. The file is memory-mapped; a tensor's
    blocks are read when it is packed."""

    def __init__(self, path: Path, config):
        arch, table, blob = _table(path)
        self.tensors = {name: (kind, shape, blob[start:start + nbytes]) for name, kind, shape, start, nbytes in table}
        self.config = config
        # llama.cpp permutes the q/k rows of its `llama` architecture only (Mistral's included)
        self.permuted = arch == "llama"
        self._stored: dict[str, StoredWeight] = {}

    def _gguf_name(self, name: str) -> str | None:
        stem, _, leaf = name.rpartition(".")
        if stem in _TOP:
            return f"{_TOP[stem]}.{leaf}"
        parts = stem.split(".")
        if len(parts) >= 4 and parts[:2] == ["model", "layers"]:
            sub = _LAYER.get(".".join(parts[3:]))
            if sub is not None:
                return f"blk.{parts[2]}.{sub}.{leaf}"
        return None

    def has(self, name: str) -> bool:
        g = self._gguf_name(name)
        return g is not None and g in self.tensors

    def get(self, name: str) -> torch.Tensor | StoredWeight:
        g = self._gguf_name(name)
        if g is None or g not in self.tensors:
            raise KeyError(name)
        if g in self._stored:
            return self._stored[g]
        kind, shape, data = self.tensors[g]
        if len(shape) == 2:
            data = data.reshape(shape[0], -1)
            if self.permuted and (".attn_q." in g or ".attn_k." in g):   # llama.cpp's rotary layout, rows only
                data = _unpermute(data, self.config.num_attention_heads if ".attn_q." in g
                                  else self.config.num_key_value_heads)
        if kind == "F32":
            return torch.from_numpy(np.array(data).view(np.float32).reshape(shape))
        if len(shape) != 2:
            raise ValueError(f"{g}: a {kind} tensor of {len(shape)} dims")
        if kind not in TYPES:
            raise ValueError(f"{g}: GGUF type {kind} is not supported (supported: F32, {', '.join(TYPES)})")
        w = pack(kind, data, shape)
        self._stored[g] = w
        return w


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permutation of the q/k projections' rows (transformers does the same
    on the de-quantized weights; on whole rows of blocks it is the same reordering)."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def _table(path: Path) -> tuple[str, list[tuple[str, str, tuple[int, ...], int, int]], np.ndarray]:
    """(architecture, [(name, GGUF type, shape in torch order, byte offset, bytes)], the file
    memory-mapped), from the file's header and tensor table (transformers' fast readers of both;
    the byte counts from gguf-py's table of block sizes, which knows every type)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from transformers.integrations.gguf.reader import _read_metadata, _read_tensor_table

    blob = np.memmap(str(path), mode="r", dtype=np.uint8)
    md, count, pos = _read_metadata(blob, str(path))
    entries, pos = _read_tensor_table(blob, count, pos)
    align = md.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    table = []
    for name, shape, ggml_type, offset in entries:
        qt = GGMLQuantizationType(ggml_type)
        per, size = GGML_QUANT_SIZES[qt]
        table.append((name, qt.name, tuple(shape), start + offset, int(np.prod(shape)) // per * size))
    return md["general.architecture"], table, blob


def gguf_architecture(path: Path) -> tuple[str, list[str]]:
    """(llama.cpp's architecture name, the GGUF types of its 2-D tensors)."""
    arch, table, _ = _table(path)
    return arch, sorted({kind for _, kind, shape, _, _ in table if len(shape) == 2})


def gguf_config(path: Path):
    """The transformers config of a GGUF file of a family probity's own forward serves, from
    its metadata alone."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import read_gguf_metadata

    md, names = read_gguf_metadata(str(path))
    arch = md["general.architecture"]
    model_type = "mistral" if arch == "llama" and "mistral" in str(md.get("general.name", "")).lower() else arch
    cfg = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}))
    for key, attr in (GGUF_CONFIG_MAPPING.get(model_type) or GGUF_CONFIG_MAPPING[arch]).items():
        v = md.get(f"{arch}.{key}")
        if v is not None and attr not in (None, -1):
            cfg[attr] = v
    cfg["tie_word_embeddings"] = "output.weight" not in names
    for key, attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        if md.get(f"tokenizer.ggml.{key}") is not None:
            cfg[attr] = md[f"tokenizer.ggml.{key}"]
    if "vocab_size" not in cfg:
        tokens = md["tokenizer.ggml.tokens"]
        cfg["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return AutoConfig.for_model(model_type, **cfg)
