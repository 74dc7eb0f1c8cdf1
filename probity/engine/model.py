"""Which forward serves a model: probity's own Llama-family forward (llama.py) where it
applies, else transformers' own modules with probity's invariant pieces plugged in
(transformers_model.py); or a refusal by name, when neither can serve it exactly."""
from __future__ import annotations

from . import llama
from .checkpoint import ModuleWeights
from .llama import LlamaModel
from .transformers_model import TransformersModel, Unsupported


class UnsupportedModel(Exception):
    pass


def build(hf_model=None, *, config=None, weights=None, consume: bool = False) -> LlamaModel | TransformersModel:
    """The forward for a loaded transformers model, or for a checkpoint read as stored
    (`config` and `weights`, checkpoint.py: only probity's own forward reads those).
    `consume`: probity's own forward may empty the transformers model as it reads it."""
    if hf_model is not None:
        config, weights = hf_model.config, ModuleWeights(hf_model, consume)
    if llama.serves(config) is None:
        return LlamaModel(config, weights)
    family = getattr(config, "model_type", type(hf_model).__name__)
    if hf_model is None:
        raise UnsupportedModel(f"model type {family!r} is read as stored only by probity's own forward")
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
