"""Run a causal LM one chunk at a time against a per-sequence KV cache.

``make_runner`` picks the compact Llama forward (``fast_llama``) when the
model is a plain Llama on the CPU, and transformers' own forward
(``hf_runner``, batch-invariant for a verifier: ``batch_invariant``) for
anything else — every model on a GPU. All give the same interface: ``new_cache``,
``import_payload``, ``forward``, ``forward_batch`` (several sequences'
chunks in one pass: the compact forward reads each weight once for all).

On a GPU the forward and the KV stay on the device; the logits come back to
the host (float32, [n, vocab_size]: a few hundred KB per step), where the
exact sampler draws with a seeded CPU generator — so a seed gives the same
random stream whatever the device, and accept / reject is the same code.
"""

from __future__ import annotations

import logging

import torch

from services import batch_invariant as invariant
from services import fast_llama
from services.hf_runner import ModelRunner
from services.loading import LoadedModel

logger = logging.getLogger(__name__)


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
