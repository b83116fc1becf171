"""Run a causal LM one chunk at a time against a per-sequence KV cache.

``make_runner`` picks the compact Llama forward (``fast_llama``) when the
model is a plain Llama on the CPU, and transformers' own forward for anything
else — every model on a GPU. Both give the same interface: ``new_cache``,
``import_payload``, ``forward``, ``forward_batch`` (several sequences'
chunks in one pass: the compact forward reads each weight once for all).

On a GPU the forward and the KV stay on the device; the logits come back to
the host (float32, [n, vocab_size]: a few hundred KB per step), where the
exact sampler draws with a seeded CPU generator — so a seed gives the same
random stream whatever the device, and accept / reject is the same code.
"""

from __future__ import annotations

import inspect
import logging

import torch

from services.draft_vocab import scatter_kept
from services.kv import KVCache, KVPayload
from services.loading import LoadedModel

logger = logging.getLogger(__name__)


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


def make_runner(loaded: LoadedModel, *, fast: bool = True, kept_ids: torch.Tensor | None = None,
                weight_storage: torch.dtype | None = None, batch_invariant: bool = False,
                kv_capacity: int | None = None, pass_slots: int = 1):
    """The fastest runner that supports ``loaded`` (``fast=False`` forces transformers' forward).

    ``kept_ids`` [N] prunes the LM head to those ids (a drafter's pruned vocabulary, services.draft_vocab):
    logits elsewhere are -inf. ``weight_storage`` (a drafter's: torch.bfloat16): the compact forward's matmul
    weights in that precision (fast_llama.Linear); transformers' forward ignores it. ``batch_invariant`` (a
    verifier's): where transformers' forward runs, it runs batch-invariant (services.batch_invariant) over static
    KV buffers of ``kv_capacity`` positions (default: the model's context), ``pass_slots`` sessions a pass, and it
    replaces the compact forward where that one is not batch-invariant itself (not float32, or its kernels not built:
    ``fast_llama.batch_invariant``).
    """
    from services import batch_invariant as invariant
    from services import fast_llama

    if fast and loaded.model.device.type == "cpu" and fast_llama.supports(loaded.model.config) \
            and (not batch_invariant or fast_llama.batch_invariant(loaded.model.dtype)):
        return fast_llama.FastLlamaRunner(loaded, kept_ids=kept_ids, weight_storage=weight_storage)
    if batch_invariant and kept_ids is None:
        if invariant.supports(loaded.config):
            return invariant.BatchInvariantRunner(loaded, capacity=kv_capacity, slots=pass_slots)
        logger.warning("%s: transformers' forward is not batch-invariant for this architecture (its KV does not fit "
                       "a static buffer): greedy output may differ from the target alone where two logits nearly tie",
                       loaded.model_id)
    return ModelRunner(loaded, kept_ids=kept_ids)


WARMUP_ROWS = (1, 2, 3, 4)  # verify / decode chunk sizes whose matmul plans are worth tuning before the first request


def warm_up(runner, rows: tuple[int, ...] = WARMUP_ROWS) -> None:
    """Build the kernels and tune the matmul plans of the common chunk sizes, so the first request is not slow."""
    cache = runner.new_cache()
    for n in rows:
        runner.forward(torch.zeros(n, dtype=torch.long), cache)
