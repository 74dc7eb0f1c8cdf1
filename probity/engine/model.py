"""The transformer forward in plain torch: weights in, a step's rows through every layer,
final hidden states out, each row's K/V written into the paged pool on the way.

Batch invariance is a property of this file and the pieces it calls: a row's result must not
depend on which other rows share the step, where it sits among them, how its prompt was
chunked, or whether it is computed in a prefill or in a decode. Linear layers are linear.py's
(oneDNN prepacked, or the kernel that gives its bits), attention is attention.py's (fixed
slices, a pairwise tree), and norms, rotary embeddings and activations work per row or per
element (kernels.rms_norm, kernels.rotate). tests/test_invariance.py checks it bit for bit.

Families: Llama, Mistral, Qwen2, Qwen3 (their weights read from the transformers module).
Anything else is refused at startup rather than served wrongly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttnGroup, Kept, attend
from .kernels import rms_norm, rotate
from .linear import Linear

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


class UnsupportedModel(Exception):
    pass


def check_supported(config) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise UnsupportedModel(
            f"model type {kind!r} is not supported by probity's engine (supported: {', '.join(SUPPORTED)}); "
            "refusing to serve it rather than serve it wrongly")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        raise UnsupportedModel(f"rope type {rope!r} is not supported (its angles depend on the sequence length)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"activation {config.hidden_act!r} is not supported")
    if getattr(config, "use_sliding_window", False) and "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise UnsupportedModel("sliding-window attention layers are not supported")


@dataclass
class Layer:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    ln_in: torch.Tensor
    ln_post: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class Model:
    def __init__(self, hf_model, num_blocks: int, block_size: int):
        cfg = hf_model.config
        check_supported(cfg)
        self.cfg = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.eps = float(cfg.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.fused_decode = False  # a decode group's attention in the kernel: where calibration finds it gives these bits
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight.detach().float()
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.detach().float()
        self.rope_scaling = float(rot.attention_scaling)
        self.norm = inner.norm.weight.detach().float()
        self.head = Linear(hf_model.get_output_embeddings().weight)
        self.vocab_size = self.head.out_features
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            cat_bias = None
            if a.q_proj.bias is not None:
                cat_bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            self.layers.append(Layer(
                qkv=Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), cat_bias),
                o=Linear(a.o_proj.weight, a.o_proj.bias, residual=True),
                gate_up=Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                down=Linear(m.down_proj.weight, residual=True),
                ln_in=layer.input_layernorm.weight.detach().float(),
                ln_post=layer.post_attention_layernorm.weight.detach().float(),
                q_norm=a.q_norm.weight.detach().float() if hasattr(a, "q_norm") else None,
                k_norm=a.k_norm.weight.detach().float() if hasattr(a, "k_norm") else None,
            ))
        self.block_size = block_size
        self.num_blocks = num_blocks
        L, kv, hd = len(self.layers), self.n_kv, self.head_dim
        # Block 0 is the zero block that pads block tables; it is never written. V carries a
        # column of ones, so the softmax denominator comes out of the values' own GEMM.
        # Head-major layout: gathering a sequence's blocks gives [kv, items, L, hd] as a view,
        # so attention reads the keys in place of a transposed copy.
        self.k_pool = torch.zeros(L, kv, num_blocks, block_size, hd)
        self.v_pool = torch.zeros(L, kv, num_blocks, block_size, hd + 1)
        self.v_pool[..., hd] = 1.0
        # each position's final hidden state, so echo for a cached prefix is the head over the
        # very rows that were computed (the head is row-invariant: identical logits)
        self.h_pool = torch.zeros(num_blocks, block_size, cfg.hidden_size)
        # one decode group's gathered keys and values per layer, kept from step to step
        self.kept_k: list[torch.Tensor | None] = [None] * L
        self.kept_v: list[torch.Tensor | None] = [None] * L

    def linears(self) -> list[Linear]:
        return [self.head] + [x for l in self.layers for x in (l.qkv, l.o, l.gate_up, l.down)]

    @staticmethod
    def bytes_per_token(cfg) -> int:
        n_heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        return (cfg.num_hidden_layers * kv * (2 * hd + 1) + cfg.hidden_size) * 4

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                groups: list[AttnGroup]) -> torch.Tensor:
        """Run the step's rows (all sequences' new tokens), writing their K/V into the pool at
        `slots`; returns the final hidden states [rows, hidden] (before the head)."""
        T = tokens.shape[0]
        h = self.embed[tokens]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling)[:, None, :]
        sin = (emb.sin() * self.rope_scaling)[:, None, :]
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
            self.k_pool[li].view(KV, -1, hd).index_copy_(1, slots, k.transpose(0, 1))
            self.v_pool[li].view(KV, -1, hd + 1)[:, :, :hd].index_copy_(1, slots, v.transpose(0, 1))
            if len(groups) == 1:  # then its kept rows are the step's rows, in order
                attn = attend(q, *self._keys(li, k, v, groups[0]), groups[0], self.scale, self.fused_decode)
            else:
                attn = torch.empty(T, H, hd)
                for g in groups:
                    attn.index_copy_(0, g.dest, attend(q, *self._keys(li, k, v, g), g, self.scale, self.fused_decode))
            h = layer.o(attn.reshape(T, H * hd), residual=h)
            x = rms_norm(h, layer.ln_post, self.eps)
            gu = layer.gate_up(x)
            inter = gu.shape[1] // 2
            h = layer.down(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), residual=h)
        h = rms_norm(h, self.norm, self.eps)
        self.h_pool.view(-1, h.shape[1])[slots] = h
        return h

    def hidden_at(self, slots: torch.Tensor) -> torch.Tensor:
        return self.h_pool.view(-1, self.h_pool.shape[-1])[slots]

    def drop_kept(self) -> None:
        self.kept_k = [None] * len(self.layers)
        self.kept_v = [None] * len(self.layers)

    def _keys(self, li: int, k: torch.Tensor, v: torch.Tensor, g: AttnGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys [KV, items, L, hd] and values [KV, items, L, hd+1]: gathered from the
        pool, or the ones kept from the last step with this step's new positions written in.
        Both hold the same floats at every visible position (a position past an item's own
        length may be zero in one and stale in the other: it is masked, its weight an exact 0)."""
        KV, hd = self.n_kv, self.head_dim
        L = g.nb * self.block_size
        if g.kept is Kept.REUSE:
            keys, vals = self.kept_k[li], self.kept_v[li]
            if len(g.dest) != len(k):
                k, v = k.index_select(0, g.dest), v.index_select(0, g.dest)
            keys.view(KV, -1, hd).index_copy_(1, g.new_at, k.transpose(0, 1))
            vals.view(KV, -1, hd + 1)[:, :, :hd].index_copy_(1, g.new_at, v.transpose(0, 1))
            return keys, vals
        # whole blocks as flat rows: one contiguous copy per block
        keys = self.k_pool[li].flatten(2).index_select(1, g.blocks).view(KV, g.items, L, hd)
        vals = self.v_pool[li].flatten(2).index_select(1, g.blocks).view(KV, g.items, L, hd + 1)
        if g.kept is Kept.KEEP:
            self.kept_k[li], self.kept_v[li] = keys, vals
        return keys, vals

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
