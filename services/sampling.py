"""Exact speculative sampling.

Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (arXiv 2211.17192), Algorithm 1; identical to Chen et al. 2023
("Accelerating LLM decoding with speculative sampling"). Names follow the
paper: ``q`` is the draft distribution, ``p`` the target distribution.

For each draft token x_i ~ q_i:
  - accept with probability min(1, p_i(x_i) / q_i(x_i))
    (q >= p: accept with probability p/q; q < p: always accept);
  - on the first rejection, sample the *recovered* token from
    norm(max(p_i - q_i, 0)) and stop;
  - if all k are accepted, sample a *bonus* token from p_{k+1}.
The emitted tokens are then distributed exactly as the target's.

Temperature, top-k and top-p are applied identically to p and q (the target's
warped distribution is the one reproduced); temperature 0 is greedy, where p
and q are one-hot and the rule reduces to "accept while the argmaxes agree".
Any temperature > 0 samples, however small: near 0 the warped distribution is
one-hot at the argmax (shared evenly by exact ties), never NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from services.constraint import Constraint
from services.errors import InvalidRequestError

# Temperatures at or below this are treated as greedy decoding.
GREEDY_TEMPERATURE = 0.0
MAX_TOP_LOGPROBS = 20  # most likely alternatives a request may ask for per token (the OpenAI API's limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a next-token distribution."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0  # 1 = no nucleus truncation
    seed: int | None = None  # per-request seed for reproducible samples
    # the target's log-probability of each emitted token and of its n most likely alternatives (services.logprobs);
    # None = none. Changes no token: only what the target's pass returns besides them
    logprobs: int | None = None
    # the JSON schema the answer follows (services.constraint): every distribution a token is drawn from, the
    # target's and the drafter's, is masked by the request's grammar first; None = unconstrained
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def argmax_only(self) -> bool:
        """Greedy without logprobs or a constraint: each row's argmax id is all a target pass must return
        (``kernels.greedy_head``); a constrained row's argmax is of its masked logits."""
        return self.greedy and self.logprobs is None and self.constraint is None

    def validate(self) -> "SamplingParams":
        """Raise InvalidRequestError with a user-facing message if out of range."""
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise InvalidRequestError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if self.constraint is not None:
            self.constraint.validate()
        return self


def reseeded(params: SamplingParams, position: int) -> SamplingParams:
    """The params of a session opened again after ``position`` emitted tokens (its replica was lost): a seeded request
    gets a fresh random stream, reproducible for the same position. Replaying the first stream's draws would tie the
    new tokens to the ones those draws already chose."""
    if params.seed is None:
        return params
    return replace(params, seed=(params.seed * 1_000_003 + position) % (2**63))


def make_generator(seed: int | None, stream: int) -> torch.Generator:
    """A CPU generator for one request and one consumer (prefill, draft, verify).

    ``stream`` separates the random streams of the stages so that they never
    reuse each other's draws; with ``seed`` None the draws are fresh.
    """
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed((seed * 1_000_003 + stream) % (2**63))
    return generator


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab_size]
    params: SamplingParams,
) -> torch.Tensor:  # [n, vocab_size], rows sum to 1
    """Warp logits into the distribution that sampling draws from.

    Greedy gives a one-hot row at the argmax. Otherwise temperature, then
    top-k, then top-p (the order transformers' generate uses).
    """
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    # in float64 (a float32 temperature below 1.4e-45 would round to 0), shifted so that each row's largest logit is
    # 0 (softmax is shift-invariant): dividing by any temperature > 0, down to the smallest subnormal, gives 0 at
    # the argmax and at worst -inf elsewhere, never inf - inf (NaN)
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_value = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_value, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when
        # the mass before it already reaches top_p (the first token always stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.float()


def argmax_ids(rows: torch.Tensor) -> torch.Tensor:  # [n] argmax ids, or [n, vocab_size] logits -> [n] token ids
    """The target's argmax of each row: a pass's rows as they came (ids where it computed only those:
    ``SamplingParams.argmax_only``), else of their logits (the same ids: ``FastLlamaRunner.argmax``)."""
    return rows if rows.dim() == 1 else rows.argmax(dim=-1)


def sample(
    probs: torch.Tensor,  # [n, vocab_size]
    generator: torch.Generator,
) -> torch.Tensor:  # [n] token ids
    """Draw one token per row (argmax for one-hot rows, i.e. greedy)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class SpeculativeResult:
    """Outcome of one verification step."""

    token_ids: list[int]  # accepted draft tokens, then the recovered or bonus token
    n_matches: int  # how many draft tokens were accepted (0..k)
    accepted: list[bool]  # per draft position: accepted or not (False after the first rejection)


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [k]
    target_ids: torch.Tensor,  # [k + 1]: the argmax of the target's logits at each position
) -> SpeculativeResult:
    """Algorithm 1 with one-hot p and q (temperature 0), without building them.

    p(x)/q(x) is 1 where the draft token is the target's argmax and 0
    elsewhere: accept while they agree, then emit the target's argmax (the
    recovered token, or the bonus token after k matches).
    """
    k = draft_token_ids.shape[0]
    agree = (target_ids[:k] == draft_token_ids).tolist()
    n_matches = agree.index(False) if False in agree else k
    token_ids = draft_token_ids[:n_matches].tolist() + [int(target_ids[n_matches])]
    return SpeculativeResult(token_ids, n_matches, [True] * n_matches + [False] * (k - n_matches))


def speculative_sample(
    draft_token_ids: torch.Tensor,  # [k]
    q: torch.Tensor,  # [k, vocab_size] draft distributions the tokens were drawn from
    p: torch.Tensor,  # [k + 1, vocab_size] target distributions (last row: bonus position)
    generator: torch.Generator,
) -> SpeculativeResult:
    """Accept/reject ``draft_token_ids`` so the output follows ``p`` exactly (Algorithm 1)."""
    k = draft_token_ids.shape[0]
    if k:
        positions = torch.arange(k)
        p_x = p[positions, draft_token_ids]  # [k]
        q_x = q[positions, draft_token_ids]  # [k]
        r = torch.rand(k, generator=generator)  # [k]
        # accept iff r < p(x)/q(x); written as r * q < p to avoid dividing by q
        accepted = (r * q_x < p_x).tolist()
    else:
        accepted = []
    n_matches = accepted.index(False) if False in accepted else k
    token_ids = draft_token_ids[:n_matches].tolist()
    if n_matches < k:
        # rejected: the recovered token comes from norm(max(p - q, 0))
        residual = torch.clamp(p[n_matches] - q[n_matches], min=0.0)
        total = residual.sum()
        # p == q at that position makes rejection impossible; guard the
        # all-zero residual that rounding could still produce
        residual = residual / total if total > 0 else p[n_matches]
        next_token = sample(residual[None], generator)[0]
    else:
        next_token = sample(p[k][None], generator)[0]  # bonus token
    token_ids.append(int(next_token))
    accepted = [bool(a) for a in accepted[:n_matches]] + [False] * (k - n_matches)
    return SpeculativeResult(token_ids=token_ids, n_matches=n_matches, accepted=accepted)
