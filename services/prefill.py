"""Prefill: run the target over the prompt, sample the first token, export the KV."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kv import KVPayload
from services.loading import LoadedModel
from services.runner import make_runner
from services.sampling import SamplingParams, logits_to_probs, make_generator, sample
from services.validation import validate_prompt

PREFILL_STREAM = 0  # random stream of the first token (see sampling.make_generator)
FEATURE_DTYPE = torch.bfloat16  # features handed to a drafter (what the EAGLE head was trained on)


@dataclass
class PrefillResult:
    first_token: int  # sampled from the target's distribution after the prompt
    payload: KVPayload  # KV of the prompt positions, to hand to a verifier
    features: torch.Tensor | None = None  # [n, hidden] bf16 target features of the prompt (feature drafters, EAGLE)


class PrefillEngine:
    """Stateless prefill of the target model."""

    def __init__(self, target: LoadedModel):
        self.target = target
        self.runner = make_runner(target)

    def prefill(self, prompt_ids: Sequence[int], params: SamplingParams, *, features: bool = False) -> PrefillResult:
        """Prefill the prompt; ``features`` also returns the target's features of every prompt position."""
        params.validate()
        ids = validate_prompt(prompt_ids, max_context=self.target.max_context, vocab_size=self.target.vocab_size)
        cache = self.runner.new_cache()
        out = self.runner.forward(torch.tensor(ids), cache, last_only=True, return_features=features)
        logits, feats = out if features else (out, None)  # [1, vocab_size], [n, hidden]
        first_token = int(sample(logits_to_probs(logits, params), make_generator(params.seed, PREFILL_STREAM))[0])
        return PrefillResult(
            first_token=first_token,
            payload=cache.export(self.target.fingerprint),
            features=feats.to(FEATURE_DTYPE) if feats is not None else None,
        )
