"""Run a causal LM one chunk at a time against a ``KVCache``."""

from __future__ import annotations

import torch

from services.kv import KVCache
from services.loading import LoadedModel


class ModelRunner:
    """Forward passes of one loaded model, appending to a per-sequence KV cache."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model

    def new_cache(self) -> KVCache:
        return KVCache(self.model.config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [n] tokens that follow the cached prefix
        cache: KVCache,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:  # [n, vocab_size] float32 logits ([1, vocab_size] with last_only)
        """Append ``input_ids`` to ``cache`` and return next-token logits at each position."""
        out = self.model(
            input_ids=input_ids[None],
            cache=cache.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits[0].float()
