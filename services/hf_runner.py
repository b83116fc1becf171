"""transformers' own forward behind the runner interface, against a per-sequence ``DynamicCache``.

The path of every model the compact forward (``fast_llama``) does not take: any model on a GPU, other
architectures on the CPU. ``services.runner.make_runner`` picks between them; ``batch_invariant`` builds on it.
"""

from __future__ import annotations

import inspect

import torch

from services.draft_vocab import scatter_kept
from services.kv import KVCache, KVPayload
from services.loading import LoadedModel


class ModelRunner:
    """Generic path: transformers' forward with a ``DynamicCache``."""

    supports_trees = False  # verify blocks are chains here (services.tree needs the compact forward)

    def __init__(self, loaded: LoadedModel, *, kept_ids: torch.Tensor | None = None):  # kept_ids: [N], None = full head
        self.loaded = loaded
        self.model = loaded.model
        # pruned draft vocabulary: masked after the full head (same q as the compact forward, no saving)
        self.kept_ids = kept_ids
        self._cache_kwarg = cache_kwarg(self.model)

    def new_cache(self) -> KVCache:
        return KVCache(self.model.config)

    def import_payload(self, payload: KVPayload) -> KVCache:
        return KVCache.from_payload(self.model.config, payload, self.loaded.fingerprint, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [n] tokens that follow the cached prefix
        cache: KVCache,
        *,
        last_only: bool = False,
        return_features: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [n, vocab_size] float32 logits ([1, vocab_size] with last_only)
        """Append ``input_ids`` to ``cache`` and return next-token logits at each position.

        With ``return_features`` also the last hidden state of every row (after the final norm), [n, hidden].
        """
        out = self.model(
            input_ids=input_ids.to(self.model.device)[None],
            **{self._cache_kwarg: cache.cache},
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=return_features,
        )
        logits = out.logits[0].float().cpu()  # [m, vocab_size] on the host, for the sampler
        if self.kept_ids is not None:
            logits = scatter_kept(logits[:, self.kept_ids], self.kept_ids, logits.shape[-1])
        return (logits, out.hidden_states[-1][0].cpu()) if return_features else logits


    def forward_batch(
        self,
        chunks: list[tuple[torch.Tensor, KVCache]],  # per sequence: its new tokens [n_i] and its own KV
        *,
        last_only: bool | list[bool] = False,  # a list: per chunk
        greedy: list[bool] | None = None,  # per chunk: its argmax ids [n_i or 1] instead of its logits
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # per sequence: logits [n_i or 1, vocab_size], features [n_i, hidden]
        """Each chunk in turn (transformers' cache holds one sequence: no shared pass here, same results)."""
        last = last_only if isinstance(last_only, list) else [last_only] * len(chunks)
        outs = self._chunk_outputs(chunks, last)
        greedy = greedy or [False] * len(chunks)
        return [logits.argmax(-1) if flag else logits for (logits, _), flag in zip(outs, greedy)], [f for _, f in outs]

    def _chunk_outputs(self, chunks, last: list[bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per chunk: (logits, features) of its forward, each chunk in its own pass."""
        return [self.forward(ids, cache, last_only=flag, return_features=True)
                for (ids, cache), flag in zip(chunks, last, strict=True)]


def cache_kwarg(model) -> str:
    """The forward's name for the KV cache: ``cache`` in newer transformers, ``past_key_values`` before (an unknown
    keyword would be swallowed by ``**kwargs`` and the cache silently left empty)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
