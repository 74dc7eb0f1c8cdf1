"""Which forward serves a model: probity's own Llama-family forward (llama.py) where it
applies, else transformers' own modules with probity's invariant pieces plugged in
(transformers_model.py); or a refusal by name, when neither can serve it exactly."""
from __future__ import annotations

from . import llama
from .llama import LlamaModel
from .transformers_model import TransformersModel, Unsupported


class UnsupportedModel(Exception):
    pass


def build(hf_model) -> LlamaModel | TransformersModel:
    if llama.serves(hf_model.config) is None:
        return LlamaModel(hf_model)
    family = getattr(hf_model.config, "model_type", type(hf_model).__name__)
    try:
        return TransformersModel(hf_model)
    except Unsupported as e:
        raise UnsupportedModel(f"model type {family!r} cannot be served exactly by probity's engine ({e}); "
                               "vLLM may serve it: --backend vllm") from None
    except Exception as e:  # transformers could not run it the way probity needs
        raise UnsupportedModel(f"model type {family!r} cannot be served by probity's engine: transformers' forward "
                               f"failed under it ({type(e).__name__}: {e}); vLLM may serve it: --backend vllm") from None


def path(model) -> str:
    """Which forward serves it, for the log and docs."""
    return "probity's Llama-family forward" if isinstance(model, LlamaModel) else (
        f"transformers' modules with probity's pieces ({', '.join(sorted(set(model.swapped)))} replaced)")
