"""The sequential speculative-decoding loop: prefill -> draft -> verify -> accept.

This is the reference the distributed Ray Serve graph must match step for
step, and what ``splitspec bench engine`` measures. Numbered steps match the
stage names.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from services.draft import FEATURE_DRAFTERS, MODEL_DRAFTER, DraftEngine
from services.policy import AdaptiveK
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.validation import validate_max_new_tokens, validate_num_draft_tokens, validate_prompt
from services.verify import VerifyEngine

FINISH_STOP = "stop"  # an end-of-sequence token was generated
FINISH_LENGTH = "length"  # max_new_tokens reached


@dataclass
class StepOutput:
    """Tokens one step emitted (the first step is prefill's first token)."""

    token_ids: list[int]
    n_drafted: int = 0  # draft tokens proposed in this step
    n_matches: int = 0  # of which the target accepted
    accepted: list[bool] = field(default_factory=list)  # per draft position
    finish_reason: str | None = None


@dataclass
class SpeculationStats:
    steps: int = 0  # verify steps (target forward passes after prefill)
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, step: StepOutput) -> None:
        self.steps += 1
        self.drafted += step.n_drafted
        self.accepted += step.n_matches
        for position, ok in enumerate(step.accepted):
            if position == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += int(ok)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts + the recovered or bonus token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    stats: SpeculationStats


def speculative_decode(
    prefill: PrefillEngine,
    draft: DraftEngine | None,
    verify: VerifyEngine,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    num_draft_tokens: int,
    params: SamplingParams,
    drafter: str = MODEL_DRAFTER,
    request_id: str | None = None,
    policy: AdaptiveK | None = None,
) -> Iterator[StepOutput]:
    """Yield each step's new tokens until EOS or ``max_new_tokens``. ``draft=None`` turns speculation off.

    ``policy`` picks k for every step (0 included; services.policy) from the costs it measures here;
    without one, k is ``num_draft_tokens`` throughout.
    """
    request_id = request_id or uuid.uuid4().hex
    target = prefill.target
    params.validate()
    if draft is not None:
        validate_num_draft_tokens(num_draft_tokens)
    eos = target.eos_token_ids
    prompt_ids = validate_prompt(prompt_ids, max_context=target.max_context, vocab_size=target.vocab_size)
    validate_max_new_tokens(max_new_tokens, prompt_len=len(prompt_ids), max_context=target.max_context)
    features = draft is not None and drafter in FEATURE_DRAFTERS  # the drafter reads the target's features
    # 1. prefill the target (and start the draft session over the same prompt)
    result = prefill.prefill(prompt_ids, params, features=features)
    if draft is not None:
        draft.start(request_id, prompt_ids, params, drafter, result.features)
    try:
        # 2. hand the prefill KV to the verifier
        verify.open(request_id, result.payload, result.first_token, params, features=features)
        if draft is not None:
            draft.accept(request_id, 0, result.first_token)  # the drafter continues from prefill's token
        generated = 0
        drafted_last_step = False
        step = StepOutput([result.first_token])
        while True:
            step, generated = finish_step(step, generated, max_new_tokens, eos)
            yield step
            if step.finish_reason:
                return
            remaining = max_new_tokens - generated
            if draft is None:
                k = 0
            elif policy is not None:
                k = policy.choose(remaining)
            else:
                k = min(num_draft_tokens, remaining - 1)
            # 3. draft k tokens
            start = time.perf_counter()
            proposal = draft.propose(request_id, k) if k > 0 else None
            proposed = time.perf_counter()
            draft_ids = proposal.token_ids if proposal else []
            # 4. verify them in one target pass
            verdict = verify.verify(request_id, draft_ids, proposal.probs if proposal else None)
            if policy is not None:
                if k > 0 and drafted_last_step:  # otherwise the proposal also caught the drafter up
                    policy.costs.observe_propose(k, proposed - start)
                drafted_last_step = k > 0
                policy.costs.observe_verify(len(draft_ids) + 1, time.perf_counter() - proposed)
                policy.observe(len(draft_ids), verdict.n_matches)
            # 5. accept: roll the drafter back to the accepted prefix
            if draft is not None:
                draft.accept(request_id, verdict.n_matches, verdict.token_ids[-1], verdict.features)  # n_matches is 0 without a proposal
            step = StepOutput(verdict.token_ids, len(draft_ids), verdict.n_matches, verdict.accepted)
    finally:
        verify.close(request_id)
        if draft is not None:
            draft.close(request_id)


def finish_step(step: StepOutput, generated: int, max_new_tokens: int, eos: set[int]) -> tuple[StepOutput, int]:
    """Cut a step at the first EOS or at the token budget and set its finish reason."""
    tokens = step.token_ids
    for i, token in enumerate(tokens):
        if token in eos:
            tokens, step.finish_reason = tokens[: i + 1], FINISH_STOP
            break
    if generated + len(tokens) >= max_new_tokens:
        tokens = tokens[: max_new_tokens - generated]
        step.finish_reason = step.finish_reason or FINISH_LENGTH
    step.token_ids = tokens
    return step, generated + len(tokens)


def generate(*args, **kwargs) -> GenerationResult:
    """Run ``speculative_decode`` to the end and collect its tokens and statistics."""
    tokens: list[int] = []
    stats = SpeculationStats()
    finish_reason = FINISH_LENGTH
    for i, step in enumerate(speculative_decode(*args, **kwargs)):
        tokens += step.token_ids
        if i:  # step 0 is prefill's first token, not a verify step
            stats.add(step)
        finish_reason = step.finish_reason or finish_reason
    return GenerationResult(tokens, finish_reason, stats)
