"""probity's own forward for the Llama family, in plain torch: weights in, a step's rows
through every layer, final hidden states out, each row's K/V written into the paged pool on
the way. It is the fast path (fused QKV and gate/up projections, residual adds fused into the
GEMMs, the kernels' norms and rotary); every other family takes transformers' own modules
(transformers_model.py).

Batch invariance is a property of this file and the pieces it calls: a row's result must not
depend on which other rows share the step, where it sits among them, how its prompt was
chunked, or whether it is computed in a prefill or in a decode -- nor on the CPU it runs on.
Every operation is one of probity's kernels, each one fixed sequence of float operations on
every instruction-set path: linear.py's linears, attention.py's attention (fixed slices, a
pairwise tree), and the per-row or per-element norms, rotary embedding with its cos/sin, and
SiLU (kernels.rms_norm, rotate, cos_sin, silu_mul). tests/test_invariance.py checks it bit
for bit, tests/test_numerics.py across paths.

Families: Llama, Mistral, Qwen2, Qwen3 without sliding-window layers (their weights read from
the transformers module); `serves(config)` says whether a config is one of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import kernels, stored
from .attention import AttnGroup, PagedKV
from .stored import StoredWeight
from .kernels import cos_sin, rms_norm, rotate, silu_mul
from .linear import Linear

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def serves(config) -> str | None:
    """None if this forward serves the config, else why not."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model type {kind!r} is not one of {', '.join(SUPPORTED)}"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope type {rope!r}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if "sliding_attention" in (getattr(config, "layer_types", None) or []) or (
            kind == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding-window attention layers"
    return None


@dataclass
class Layer:
    qkv: "Linear | Concat"
    o: Linear
    gate_up: "Linear | Concat"
    down: Linear
    ln_in: torch.Tensor
    ln_post: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class Concat:
    """Projections that the model reads as one (q, k, v; gate, up) but whose weights could not
    be joined (stored in different types): each computes its own columns, which is the same
    per-output reduction as the joined call."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=1)


def _joined(weights, names: list[str], biases: list[str] | None = None) -> Linear | Concat:
    """One Linear over the rows of several weights where they can be joined as stored."""
    ws = [_linear_weight(weights.get(n)) for n in names]
    bs = [weights.get(b).float() for b in biases] if biases else None
    bias = torch.cat(bs) if bs else None
    if all(isinstance(w, torch.Tensor) for w in ws):
        return Linear(torch.cat(ws), bias)
    if all(isinstance(w, StoredWeight) and w.kind == ws[0].kind and w.shape[0] % 16 == 0 for w in ws):
        n = sum(w.shape[0] for w in ws)
        return Linear(StoredWeight(ws[0].kind, (n, ws[0].shape[1]), torch.cat([w.packed for w in ws])), bias)
    return Concat([Linear(w, None if bs is None else b) for w, b in zip(ws, bs or [None] * len(ws))])


def _linear_weight(t):
    """A linear layer's weight as probity keeps it: 16-bit tensors as stored (where the build
    keeps stored weights; else float32, the same values), others float32."""
    if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16):
        return stored.from_tensor(t) if kernels.stores() else t.float()
    return t


def _vector(t) -> torch.Tensor:
    return t.detach().float()


class LlamaModel:
    """`weights`: the checkpoint's tensors by transformers name (checkpoint.py)."""

    def __init__(self, cfg, weights):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.cfg = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.eps = float(cfg.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.fused_decode = False  # a decode group's attention in one kernel (the runner sets it where the build has it)
        embed = _linear_weight(weights.get("model.embed_tokens.weight"))
        self.embed = embed if isinstance(embed, StoredWeight) else embed.float()
        rot = LlamaRotaryEmbedding(cfg)
        self.inv_freq = rot.inv_freq.detach().float()
        self.rope_scaling = float(rot.attention_scaling)
        self.norm = _vector(weights.get("model.norm.weight"))
        head = "lm_head.weight" if weights.has("lm_head.weight") and not cfg.tie_word_embeddings else None
        self.head = Linear(_linear_weight(weights.get(head)) if head else self.embed)
        self.vocab_size = self.head.out_features
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            bias = [p + f"self_attn.{x}_proj.bias" for x in "qkv"] if weights.has(p + "self_attn.q_proj.bias") else None
            o_bias = weights.get(p + "self_attn.o_proj.bias").float() if weights.has(p + "self_attn.o_proj.bias") else None
            self.layers.append(Layer(
                qkv=_joined(weights, qkv, bias),
                o=Linear(_linear_weight(weights.get(p + "self_attn.o_proj.weight")), o_bias, residual=True),
                gate_up=_joined(weights, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=Linear(_linear_weight(weights.get(p + "mlp.down_proj.weight")), residual=True),
                ln_in=_vector(weights.get(p + "input_layernorm.weight")),
                ln_post=_vector(weights.get(p + "post_attention_layernorm.weight")),
                q_norm=_vector(weights.get(p + "self_attn.q_norm.weight")) if weights.has(p + "self_attn.q_norm.weight") else None,
                k_norm=_vector(weights.get(p + "self_attn.k_norm.weight")) if weights.has(p + "self_attn.k_norm.weight") else None,
            ))
        self.hidden_size = cfg.hidden_size
        self.family = cfg.model_type
        self.kv: PagedKV | None = None   # allocate() makes it

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.kv = PagedKV(len(self.layers), self.n_kv, self.head_dim, num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return PagedKV.bytes_per_token(len(self.layers), self.n_kv, self.head_dim)

    def linears(self) -> list[Linear]:
        out = [self.head]
        for l in self.layers:
            for x in (l.qkv, l.o, l.gate_up, l.down):
                out += x.parts if isinstance(x, Concat) else [x]
        return out

    def weight_tensors(self) -> list[torch.Tensor]:
        """The weights other than the linears' (memory accounting; a stored embedding is the
        head's weight too, counted with the linears)."""
        embed = [self.embed] if isinstance(self.embed, torch.Tensor) else []
        return embed + [self.norm] + [t for l in self.layers for t in (l.ln_in, l.ln_post, l.q_norm, l.k_norm)
                                      if t is not None]

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                groups: list[AttnGroup]) -> torch.Tensor:
        """Run the step's rows (all sequences' new tokens), writing their K/V into the pool at
        `slots`; returns the final hidden states [rows, hidden] (before the head)."""
        T = tokens.shape[0]
        h = self.embed.rows(tokens) if isinstance(self.embed, StoredWeight) else self.embed[tokens]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        c, s = cos_sin(freqs)
        cos = (torch.cat((c, c), dim=-1) * self.rope_scaling)[:, None, :]
        sin = (torch.cat((s, s), dim=-1) * self.rope_scaling)[:, None, :]
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)   # rotate()'s signed sin
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        for li, layer in enumerate(self.layers):
            x = rms_norm(h, layer.ln_in, self.eps)
            qkv = layer.qkv(x)
            v = qkv[:, (H + KV) * hd:].view(T, KV, hd)
            if layer.q_norm is None:
                qk = rotate(qkv[:, : (H + KV) * hd].view(T, H + KV, hd), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            else:
                q = rotate(rms_norm(qkv[:, : H * hd].view(T, H, hd), layer.q_norm, self.eps), cos, sin)
                k = rotate(rms_norm(qkv[:, H * hd: (H + KV) * hd].view(T, KV, hd), layer.k_norm, self.eps), cos, sin)
            attn = self.kv.attention(li, q, k, v, slots, groups, self.scale, self.fused_decode)
            h = layer.o(attn.reshape(T, H * hd), residual=h)
            x = rms_norm(h, layer.ln_post, self.eps)
            h = layer.down(silu_mul(layer.gate_up(x)), residual=h)
        return rms_norm(h, self.norm, self.eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
