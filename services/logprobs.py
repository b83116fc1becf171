"""Log-probabilities of the emitted tokens: the target's, from the rows of its pass that chose them.

A token's logprob is log p(x) under the distribution the sampler draws it from: the target's logits at the
request's temperature, top-k and top-p (``sampling.logits_to_probs``: the processed distribution, as vLLM's
``processed_logprobs``). Greedy requests (temperature 0) sample nothing; for them it is the target's log-softmax
of the raw logits. Under speculation every emitted token gets the row of the target's pass that it follows: an
accepted draft token its own position's p, the recovered or bonus token the p of the row after the last accepted
draft (the distribution it is emitted under: Algorithm 1 makes the output follow p exactly), so the values are
those the target alone gives, whatever the drafter proposed.

``top`` holds the ``n`` most likely tokens of that distribution (``SamplingParams.logprobs``), the likeliest
first (ties in id order); a token that top-k or top-p excluded has probability 0: its logprob is ``LOGPROB_FLOOR``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.sampling import SamplingParams, logits_to_probs

# the logprob of a token the distribution excludes (top-k / top-p): -inf has no JSON spelling (vLLM's floor)
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's logprob, and the most likely tokens of its row's distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), the likeliest first


def target_logprobs(
    logits: torch.Tensor,  # [n, vocab_size]
    params: SamplingParams,
) -> torch.Tensor:  # [n, vocab_size] float64, LOGPROB_FLOOR where the probability is 0
    """The log of the distribution the request samples from (greedy: the log-softmax of the raw logits)."""
    if params.greedy:
        logprobs = torch.log_softmax(logits.double(), dim=-1)
    else:
        logprobs = torch.log(logits_to_probs(logits, params).double())
    return logprobs.clamp(min=LOGPROB_FLOOR)


def token_logprobs(
    logits: torch.Tensor,  # [n, vocab_size]: row i is the distribution token i was emitted under
    token_ids: Sequence[int],  # [n]
    params: SamplingParams,
) -> list[TokenLogprob]:
    """Each emitted token's logprob and its row's ``params.logprobs`` likeliest tokens."""
    logprobs = target_logprobs(logits, params)  # [n, vocab_size]
    n_top = params.logprobs or 0
    if n_top:  # (a stable sort: ties, such as tokens at the floor, in id order)
        top_values, top_ids = (t[:, :n_top] for t in logprobs.sort(dim=-1, descending=True, stable=True))  # [n, n_top]
    out = []
    for i, token in enumerate(token_ids):
        top = tuple(zip(top_ids[i].tolist(), top_values[i].tolist())) if n_top else ()
        out.append(TokenLogprob(int(token), float(logprobs[i, token]), top))
    return out
