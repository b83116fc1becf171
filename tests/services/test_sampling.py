"""The exact speculative sampler reproduces the target distribution."""

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from services.errors import InvalidRequestError
from services.sampling import SamplingParams, logits_to_probs, make_generator, sample, speculative_sample
from splitspec.checks.chi_square import chi_square, threshold

DRAWS = 12_000


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit of ``counts`` [V] against ``probs`` [V]."""
    assert counts[probs == 0].sum() == 0, "sampled a token of probability zero"
    stat, df = chi_square(counts, probs)
    if df < 1:
        return
    assert stat < threshold(df), f"chi2={stat:.1f} over {df} dof"


CASES = [
    # vocab, k, temperature, top_k, top_p
    (8, 1, 1.0, 0, 1.0),
    (8, 3, 0.7, 0, 1.0),
    (16, 2, 1.3, 0, 1.0),
    (16, 5, 1.0, 5, 1.0),
    (32, 4, 0.8, 0, 0.9),
    (64, 3, 1.0, 10, 0.8),
    (64, 5, 1.5, 0, 0.95),
    (64, 1, 0.5, 20, 1.0),
]


def sample_counts(
    q: torch.Tensor,  # [k, V] draft distributions
    p: torch.Tensor,  # [k + 1, V] target distributions
    gen: torch.Generator,
) -> torch.Tensor:  # [k + 1, V] counts of the token emitted at each position
    """Run Algorithm 1 DRAWS times on fresh drafts from q; assert each position's output follows p."""
    k, vocab = q.shape
    counts = torch.zeros(k + 1, vocab, dtype=torch.long)
    for _ in range(DRAWS):
        draft = sample(q, gen)  # [k]
        result = speculative_sample(draft, q, p, gen)
        for j, token in enumerate(result.token_ids):
            counts[j, token] += 1
    for j in range(k + 1):
        if counts[j].sum() >= 200:
            assert_follows(counts[j], p[j])
    return counts


@pytest.mark.parametrize("vocab,k,temperature,top_k,top_p", CASES)
def test_each_position_follows_target(vocab, k, temperature, top_k, top_p):
    """Token j of a step, given the step reached j, follows the warped target p_j (k = 1..5, V = 8..64)."""
    gen = torch.Generator().manual_seed(1000 * vocab + k)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p = logits_to_probs(torch.randn(k + 1, vocab, generator=gen) * 2, params)  # [k + 1, V]
    q = logits_to_probs(torch.randn(k, vocab, generator=gen) * 2, params)  # [k, V]
    counts = sample_counts(q, p, gen)


def test_acceptance_rate_matches_theory():
    """P(accept x_1) = sum_x min(p(x), q(x)) (Leviathan et al., Lemma 3.3)."""
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=1.0)
    p = logits_to_probs(torch.randn(2, 16, generator=gen), params)
    q = logits_to_probs(torch.randn(1, 16, generator=gen), params)
    accepted = sum(speculative_sample(sample(q, gen), q, p, gen).n_matches for _ in range(DRAWS))
    alpha = torch.minimum(p[0], q[0]).sum().item()
    sd = math.sqrt(alpha * (1 - alpha) / DRAWS)
    assert abs(accepted / DRAWS - alpha) < 4.5 * sd


def one_hot(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_accepts_matching_prefix_then_target_argmax():
    """Greedy: accept while draft == target argmax, then emit the target's argmax."""
    p = one_hot([4, 5, 6, 7], 10)  # target argmaxes at 4 positions
    result = speculative_sample(torch.tensor([4, 5, 1]), one_hot([4, 5, 1], 10), p, make_generator(0, 0))
    assert result.token_ids == [4, 5, 6]
    assert result.n_matches == 2
    assert result.accepted == [True, True, False]


def test_all_accepted_gives_bonus_token():
    p = one_hot([1, 2, 3], 5)
    result = speculative_sample(torch.tensor([1, 2]), one_hot([1, 2], 5), p, make_generator(0, 0))
    assert result.token_ids == [1, 2, 3]
    assert result.n_matches == 2


def test_no_draft_is_a_plain_sample():
    p = one_hot([3], 5)
    result = speculative_sample(torch.zeros(0, dtype=torch.long), torch.zeros(0, 5), p, make_generator(0, 0))
    assert result.token_ids == [3] and result.n_matches == 0 and result.accepted == []


def test_zero_target_probability_always_rejects_and_recovers_from_residual():
    """p(x) = 0 rejects x; the recovered token comes from norm(max(p - q, 0))."""
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 0.5, 0.0, 0.5]])
    gen = make_generator(3, 0)
    for _ in range(200):
        result = speculative_sample(torch.tensor([3]), q, p, gen)
        assert result.n_matches == 0
        assert result.token_ids == [2]  # residual is one-hot at token 2


def test_equal_distributions_always_accept():
    p = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    gen = make_generator(5, 0)
    for token in (0, 1, 2):
        assert speculative_sample(torch.tensor([token]), p[:1], p, gen).n_matches == 1


def test_seed_reproduces_samples():
    """A seed gives the same draws every time; different seeds give different ones (so the seed is used)."""
    params = SamplingParams(temperature=1.0, seed=42)
    probs = logits_to_probs(torch.zeros(1, 50), params)  # uniform: every seed's draw is as likely
    draws = lambda seed: [int(sample(probs, gen)[0]) for gen in [make_generator(seed, 1)] for _ in range(8)]  # noqa: E731
    assert draws(42) == draws(42)
    assert len({tuple(draws(seed)) for seed in range(10)}) == 10


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.2, 0, 0.8), (0.9, 8, 0.9)])
def test_warping_matches_transformers(temperature, top_k, top_p):
    """Temperature, top-k, top-p give the same distribution as transformers' warpers."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(ours, torch.softmax(ref, dim=-1), atol=1e-6, rtol=1e-5)


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0]])
    assert logits_to_probs(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "finite"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_invalid_params_raise_typed_error(kwargs, fragment):
    with pytest.raises(InvalidRequestError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs).validate()


def test_greedy_verify_equals_algorithm_1_with_one_hot_distributions():
    """The greedy shortcut gives what speculative_sample gives for one-hot p and q."""
    from services.sampling import greedy_verify

    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        logits = torch.randn(k + 1, 6, generator=gen)
        draft = torch.randint(0, 6, (k,), generator=gen)
        p = logits_to_probs(logits, SamplingParams())
        exact = speculative_sample(draft, one_hot(draft.tolist(), 6) if k else torch.zeros(0, 6), p, make_generator(0, 0))
        assert greedy_verify(draft, logits.argmax(-1)) == exact


PRUNED_CASES = [
    # vocab, kept ids, k, temperature, top_k, top_p
    (16, 8, 1, 1.0, 0, 1.0),
    (32, 8, 3, 0.8, 0, 1.0),
    (64, 16, 4, 1.2, 0, 0.9),
    (64, 40, 2, 1.0, 10, 1.0),
    (32, 6, 2, 0.9, 12, 1.0),  # top-k wider than the kept set
]


@pytest.mark.parametrize("vocab,n_kept,k,temperature,top_k,top_p", PRUNED_CASES)
def test_pruned_draft_vocabulary_still_follows_target(vocab, n_kept, k, temperature, top_k, top_p):
    """q zero outside a kept subset of ids (FR-Spec head): every position still follows the warped target p_j."""
    from services.draft_vocab import scatter_kept

    gen = torch.Generator().manual_seed(100 * vocab + n_kept)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    kept = torch.randperm(vocab, generator=gen)[:n_kept].sort().values  # [N]
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[kept] = False
    p = logits_to_probs(torch.randn(k + 1, vocab, generator=gen) * 2, params)  # [k + 1, V]
    q = logits_to_probs(scatter_kept(torch.randn(k, n_kept, generator=gen) * 2, kept, vocab), params)  # [k, V]
    assert (q[:, outside] == 0).all() and p[:, outside].sum() > 0.1 * k  # the target has real mass the drafter cannot propose
    counts = sample_counts(q, p, gen)
    assert counts[0, outside].sum() > 0  # ids outside the kept set are emitted, as recovered tokens


def test_pruned_acceptance_rate_matches_theory():
    """With q zero outside the kept ids, P(accept x_1) is still sum_x min(p(x), q(x))."""
    from services.draft_vocab import scatter_kept

    gen = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=1.0)
    kept = torch.tensor([0, 2, 3, 7, 9, 12])
    p = logits_to_probs(torch.randn(2, 16, generator=gen), params)
    q = logits_to_probs(scatter_kept(torch.randn(1, len(kept), generator=gen), kept, 16), params)
    accepted = sum(speculative_sample(sample(q, gen), q, p, gen).n_matches for _ in range(DRAWS))
    alpha = torch.minimum(p[0], q[0]).sum().item()
    sd = math.sqrt(alpha * (1 - alpha) / DRAWS)
    assert abs(accepted / DRAWS - alpha) < 4.5 * sd
