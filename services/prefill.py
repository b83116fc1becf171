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


@dataclass(frozen=True)
class PrefillCall:
    """One request's prefill, as ``PrefillEngine.prefill_batch`` takes it."""

    prompt_ids: list[int]
    params: SamplingParams
    features: bool = False  # also the target's features of every prompt position (feature drafters, EAGLE)
    request_id: str = ""  # for the batcher: one call per request in a pass

    @property
    def rows(self) -> int:
        return len(self.prompt_ids)


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
        (result,) = self.prefill_batch([PrefillCall(list(prompt_ids), params, features)])
        if isinstance(result, Exception):
            raise result
        return result

    def prefill_batch(self, calls: list[PrefillCall]) -> list[PrefillResult | Exception]:
        """Several prompts in one target pass (ragged rows, each its own KV); a prompt with bad input gets its error
        in its slot, the others go on. Each first token is drawn with its own parameters and seed."""
        results: list[PrefillResult | Exception | None] = [None] * len(calls)
        checked = []  # (slot, call, ids)
        for slot, call in enumerate(calls):
            try:
                call.params.validate()
                ids = validate_prompt(call.prompt_ids, max_context=self.target.max_context, vocab_size=self.target.vocab_size)
                checked.append((slot, call, ids))
            except Exception as exc:  # typed errors (services.errors) for the caller of that slot
                results[slot] = exc
        if not checked:
            return results
        caches = [self.runner.new_cache() for _ in checked]
        all_logits, all_features = self.runner.forward_batch(
            [(torch.tensor(ids), cache) for (_, _, ids), cache in zip(checked, caches)], last_only=True
        )  # per prompt: [1, vocab_size], [n, hidden]
        for (slot, call, _), cache, logits, feats in zip(checked, caches, all_logits, all_features):
            probs = logits_to_probs(logits, call.params)  # [1, vocab_size]
            first_token = int(sample(probs, make_generator(call.params.seed, PREFILL_STREAM))[0])
            results[slot] = PrefillResult(
                first_token=first_token,
                payload=cache.export(self.target.fingerprint),
                features=feats.to(FEATURE_DTYPE) if call.features else None,
            )
        return results
