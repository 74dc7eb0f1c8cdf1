"""Tensors in, logits out: the model and one KV cache per sequence."""
from __future__ import annotations

import torch
from transformers import DynamicCache


class ModelRunner:
    def __init__(self, model, threads: int | None = None):
        self.model = model
        if threads:
            torch.set_num_threads(threads)
        cfg = model.config
        self.context_length = int(getattr(cfg, "max_position_embeddings", 2048))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def prefill(self, ids: list[int], all_logits: bool) -> tuple[torch.Tensor, object]:
        """Run the whole prompt. Returns (logits for every position or just the last, cache)."""
        cache = DynamicCache()
        out = self.model(
            input_ids=torch.tensor([ids]), cache=cache, use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        return out.logits[0].float(), out.cache

    @torch.inference_mode()
    def decode(self, token: int, cache) -> tuple[torch.Tensor, object]:
        out = self.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        return out.logits[0, -1].float(), out.cache
