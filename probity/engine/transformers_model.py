"""The general path: any causal LM transformers can build, run through transformers' own
modules with probity's batch-invariant pieces plugged in (the shape of vLLM's Transformers
backend, but keeping the numbers exact and bit-for-bit invariant).

What is replaced, so that a row's numbers cannot depend on its companions:
- every linear layer (`nn.Linear` and its subclasses, GPT-2's `Conv1D`) by probity's Linear
  (the kernels' linear, every row count one order, as the fast path's);
- the experts of a mixture-of-experts layer (3-D `gate_up_proj`/`down_proj` weights) by the
  same loop transformers runs, each expert's projections a probity Linear: an expert sees a
  different number of tokens every step, and its rows come out the same whatever that number;
- `F.linear` on any other weight (a router's) by a probity Linear of that weight;
- attention, through transformers' attention interface, by probity's paged attention over
  the KV pool (sliding windows and soft-capping as the module asks for them).
Everything else (embeddings, norms, rotary or learned positions, activations, residuals,
routing) is transformers' own code, and works row by row. Two checks at startup make that a
measurement rather than a hope (runner.py): the forward must give transformers' own numbers
on a probe sequence (within 1e-4), and its rows must be bit-identical whatever the row count.
A model that fails either is refused by name.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels, stored
from .attention import AttnGroup, PagedKV
from .linear import Linear

ATTN = "probity"
RECORD = "probity-record"
REFERENCE_TOKENS = 24
FIDELITY = 1e-4


class Unsupported(Exception):
    pass


# ---------------------------------------------------------------- plugged-in pieces

def _kept(weight: torch.Tensor):
    """A weight as probity keeps it: 16-bit as stored (where the build keeps stored weights; else
    float32, the same values), anything else float32."""
    if weight.dtype in (torch.bfloat16, torch.float16):
        return stored.from_tensor(weight) if kernels.stores() else weight.float()
    return weight


class InvariantLinear(nn.Module):
    """A linear layer through probity's Linear, whatever the leading dims of its input."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.lin = Linear(_kept(weight), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.lin(x.reshape(-1, shape[-1]))
        return y.view(*shape[:-1], y.shape[-1])


class InvariantExperts(nn.Module):
    """transformers' expert loop (tokens grouped by expert in expert order, each expert's output
    weighted and added into its rows), each expert's projections a probity Linear."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        self.gate_up = [Linear(_kept(gate_up[e])) for e in range(self.num_experts)]
        self.down = [Linear(_kept(down[e])) for e in range(self.num_experts)]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final = torch.zeros_like(hidden_states)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            if e == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            gate, up = self.gate_up[e](hidden_states[token_idx]).chunk(2, dim=-1)
            out = self.down[e](self.act_fn(gate) * up) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


def _is_experts(m: nn.Module) -> bool:
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3 and down.dim() == 3
            and hasattr(m, "act_fn") and hasattr(m, "num_experts")
            and gu.shape[0] == down.shape[0] and gu.shape[2] == down.shape[1] and gu.shape[1] == 2 * down.shape[2]
            and not any(n.endswith("bias") for n, _ in m.named_parameters(recurse=False)))


def _replace_modules(root: nn.Module) -> list[str]:
    """Swap in the invariant pieces; returns what was swapped, by kind (for the log)."""
    from transformers.pytorch_utils import Conv1D

    swapped: list[str] = []
    for name, child in list(root.named_children()):
        new = None
        if isinstance(child, nn.Linear):
            new = InvariantLinear(child.weight.detach(), None if child.bias is None else child.bias.detach())
        elif isinstance(child, Conv1D):   # GPT-2: weight stored [in, out]
            new = InvariantLinear(child.weight.detach().t(), child.bias.detach())
        elif _is_experts(child):
            new = InvariantExperts(child)
        if new is not None:
            setattr(root, name, new)
            swapped.append(type(child).__name__)
        else:
            swapped += _replace_modules(child)
    return swapped


class _LinearDispatch:
    """`F.linear` while the model runs: a weight that is still a bare parameter of some module
    (a router's) goes through a probity Linear of it; any other weight is an error, since an
    unreplaced linear would make the rows depend on the batch."""

    def __init__(self, model: nn.Module):
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        self.lins: dict[int, Linear] = {}
        self.weights: list[torch.Tensor] = []  # held, so their ids stay theirs
        for m in model.modules():
            if isinstance(m, (InvariantLinear, InvariantExperts, nn.Embedding)):
                continue
            for p in m.parameters(recurse=False):
                if p.dim() == 2 and p.is_floating_point() and id(p) not in embeddings:
                    self.lins[id(p)] = Linear(p.detach())
                    self.weights.append(p)
        self.original = F.linear

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lin = self.lins.get(id(weight))
        if lin is None:
            raise Unsupported(f"a linear of shape {tuple(weight.shape)} that probity did not replace")
        shape = x.shape
        y = lin(x.reshape(-1, shape[-1]))
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], y.shape[-1])

    @contextlib.contextmanager
    def active(self):
        F.linear = self
        try:
            yield
        finally:
            F.linear = self.original


# ---------------------------------------------------------------- attention

def _probity_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sliding_window=None, softcap=None, **kwargs):
    """transformers' attention interface, served by probity's paged attention. query [1, H, T,
    hd], key and value [1, KV, T, hd] (rotary and norms applied by the module); returns
    [1, T, H, hd] as the interface does."""
    model: TransformersModel = module._probity_model
    if kwargs.get("s_aux") is not None:
        raise Unsupported("attention sinks")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = sliding_window if sliding_window else None
    out = model.kv.attention(module.layer_idx, q, k, v, model.slots, model.groups, scale, model.fused_decode,
                             window, softcap)
    return out[None], None


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """For the reference forward: note each layer's shapes and arguments, then run the module's
    own eager attention (transformers' reference)."""
    module._probity_seen = (query.shape[1], key.shape[1], query.shape[-1], kwargs.get("sliding_window"),
                            kwargs.get("softcap"), kwargs.get("s_aux") is not None)
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return eager(module, query, key, value, attention_mask, **kwargs)


class _SdpaRoute:
    """For attention modules that call torch's scaled_dot_product_attention themselves instead
    of transformers' attention interface (Falcon): while the model runs, that call is routed to
    probity's attention for the module that made it (a pre-hook notes which one runs)."""

    def __init__(self):
        self.current: nn.Module | None = None
        self.target = None          # the TransformersModel to serve from; None: record shapes and run torch's
        self.original = F.scaled_dot_product_attention

    def attach(self, root: nn.Module) -> int:
        n = 0
        for m in root.modules():
            if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention"):
                m.register_forward_pre_hook(self._enter)
                n += 1
        return n

    def _enter(self, module, args):
        self.current = module

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        module = self.current
        if self.target is None:
            module._probity_seen = (query.shape[1], key.shape[1], query.shape[-1], None, None, False)
            return self.original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 scale=scale, **kwargs)
        t = self.target
        q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        out = t.kv.attention(module.layer_idx, q, k, v, t.slots, t.groups,
                             scale if scale is not None else q.shape[-1] ** -0.5, t.fused_decode)
        return out.transpose(0, 1)[None]   # [1, H, T, hd], as torch's

    @contextlib.contextmanager
    def active(self):
        F.scaled_dot_product_attention = self
        try:
            yield
        finally:
            F.scaled_dot_product_attention = self.original


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN, _probity_attention)
    AttentionInterface.register(RECORD, _recording_attention)
    AttentionMaskInterface.register(ATTN, lambda *a, **k: None)   # probity builds its own masks
    AttentionMaskInterface.register(RECORD, eager_mask)


def _set_attention(model: nn.Module, impl: str) -> None:
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = impl


def _rows_output():
    from dataclasses import dataclass

    from transformers.modeling_outputs import BaseModelOutputWithPast

    @dataclass
    class Rows(BaseModelOutputWithPast):
        """The base model's output as the CausalLM reads it; whatever else it asks for is None."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None
    return Rows


class _Hidden(nn.Module):
    """Stands in for the base model inside the CausalLM's forward, so that its head and what
    it does after the head (soft-capping, scaling) run on the rows probity gives it. A part of
    the base model that the CausalLM calls directly (OPT's `.decoder`) is this stub too."""

    def __init__(self):
        super().__init__()
        self.rows: torch.Tensor | None = None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return self

    def forward(self, *args, **kwargs):
        return _Rows(last_hidden_state=self.rows[None])


_Rows = None


# ---------------------------------------------------------------- the model

class TransformersModel:
    """The same interface as LlamaModel: allocate, forward (the step's rows -> final hidden
    states), logits, linears."""

    def __init__(self, hf_model):
        global _Rows
        _register()
        _Rows = _Rows or _rows_output()
        cfg = hf_model.config
        self.cfg = cfg
        self.family = getattr(cfg, "model_type", type(hf_model).__name__)
        if getattr(cfg, "is_encoder_decoder", False):
            raise Unsupported("an encoder-decoder model")
        prefix = hf_model.base_model_prefix
        self.base = getattr(hf_model, prefix, None)
        if self.base is None:
            raise Unsupported(f"no base model at .{prefix}")
        if getattr(cfg, "alibi", False):
            raise Unsupported("ALiBi position biases")
        # the linears and experts first (16-bit weights kept as stored), the rest in float32:
        # the reference forward below then computes in float32 like everything after it
        self.swapped = _replace_modules(hf_model)
        hf_model.float()
        self.dispatch = _LinearDispatch(hf_model)
        self.sdpa: _SdpaRoute | None = None
        dims = self._attention_dims(hf_model)
        if any(d[5] for d in dims):
            raise Unsupported("attention sinks")
        shapes = {d[:3] for d in dims}
        if len(shapes) != 1:
            raise Unsupported(f"attention layers of different shapes {sorted(shapes)}")
        self.n_heads, self.n_kv, self.head_dim = shapes.pop()
        self.group = self.n_heads // self.n_kv
        self.layers = sum(1 for m in self.base.modules() if hasattr(m, "_probity_seen"))
        self.hidden_size = cfg.get_text_config().hidden_size
        self.head = hf_model.get_output_embeddings()
        if not isinstance(self.head, InvariantLinear):
            raise Unsupported("an output head that is not a linear layer")
        self.vocab_size = self.head.lin.out_features
        self._linears = [lin for m in hf_model.modules() for lin in (
            [m.lin] if isinstance(m, InvariantLinear) else m.gate_up + m.down if isinstance(m, InvariantExperts) else [])]
        self._linears += list(self.dispatch.lins.values())
        for m in self.base.modules():
            if hasattr(m, "_probity_seen"):
                m._probity_model = self
        _set_attention(hf_model, ATTN if self.sdpa is None else "sdpa")
        if self.sdpa is not None:
            self.sdpa.target = self
        self.causal = hf_model
        self.stub = _Hidden()
        setattr(hf_model, prefix, self.stub)   # the CausalLM now runs its head on given rows
        self.fused_decode = False
        self.kv: PagedKV | None = None
        self.slots: torch.Tensor | None = None
        self.groups: list[AttnGroup] = []

    def _attention_dims(self, hf_model) -> set[tuple]:
        """Each attention layer's (heads, KV heads, head dim, window, softcap, sinks), noted while
        transformers' own forward computes the reference; through its attention interface, or,
        for modules that call torch's SDPA themselves, through that call."""
        with self.dispatch.active():
            self.reference_ids, self.reference = self._reference(hf_model, RECORD)
        dims = {getattr(m, "_probity_seen", None) for m in self.base.modules()} - {None}
        if not dims:
            self.sdpa = _SdpaRoute()
            if self.sdpa.attach(self.base):
                with self.sdpa.active(), self.dispatch.active():
                    self.reference_ids, self.reference = self._reference(hf_model, "sdpa")
            dims = {getattr(m, "_probity_seen", None) for m in self.base.modules()} - {None}
        if not dims:
            raise Unsupported("its attention goes neither through transformers' attention interface nor torch's SDPA")
        return dims

    @torch.inference_mode()
    def _reference(self, hf_model, impl: str) -> tuple[list[int], torch.Tensor]:
        """transformers' own logits for a probe sequence, through its own attention (eager, or
        torch's SDPA) and masks, before probity's attention is plugged in; the layers'
        attention shapes are noted on the way."""
        gen = torch.Generator().manual_seed(0)
        head = hf_model.get_output_embeddings()
        vocab = head.lin.out_features if isinstance(head, InvariantLinear) else head.weight.shape[0]
        ids = torch.randint(0, vocab, (REFERENCE_TOKENS,), generator=gen).tolist()
        _set_attention(hf_model, impl)
        out = hf_model(input_ids=torch.tensor([ids]), use_cache=False)
        return ids, out.logits[0].float()

    @contextlib.contextmanager
    def representative_layers(self):
        """For the startup checks: the decoder's layer list cut to the first layer of each kind
        (the same module classes and the same attention window), so a check costs a few layers'
        forward whatever the depth."""
        holder, name, layers = self._layer_list()
        seen, keep = set(), []
        for layer in layers:
            attn = next((m for m in layer.modules() if hasattr(m, "_probity_seen")), None)
            key = (tuple(type(m).__name__ for m in layer.modules()), getattr(attn, "_probity_seen", None))
            if key not in seen:
                seen.add(key)
                keep.append(layer)
        setattr(holder, name, nn.ModuleList(keep))
        try:
            yield
        finally:
            setattr(holder, name, layers)

    def _layer_list(self) -> tuple[nn.Module, str, nn.ModuleList]:
        """(module, attribute, list) of the decoder's layers: the ModuleList holding one module
        per attention layer."""
        for holder in self.base.modules():
            for name, child in holder.named_children():
                if isinstance(child, nn.ModuleList) and len(child) == self.layers and all(
                        any(hasattr(m, "_probity_seen") for m in layer.modules()) for layer in child):
                    return holder, name, child
        raise Unsupported("no list of decoder layers")

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.kv = PagedKV(self.layers, self.n_kv, self.head_dim, num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return PagedKV.bytes_per_token(self.layers, self.n_kv, self.head_dim)

    def linears(self) -> list[Linear]:
        return self._linears

    def weight_tensors(self) -> list[torch.Tensor]:
        return [t for t in [*self.base.parameters(), *self.base.buffers()]]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                groups: list[AttnGroup]) -> torch.Tensor:
        self.slots, self.groups = slots, groups
        try:
            with self.dispatch.active(), (self.sdpa.active() if self.sdpa else contextlib.nullcontext()):
                out = self.base(input_ids=tokens[None], position_ids=positions[None], use_cache=False)
        finally:
            self.slots, self.groups = None, []
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.stub.rows = hidden
        try:
            with self.dispatch.active():
                out = self.causal(input_ids=torch.zeros(1, hidden.shape[0], dtype=torch.long), use_cache=False)
        finally:
            self.stub.rows = None
        return out.logits[0]
