"""Adaptive speculation: the cost model's choices, and losslessness whatever k each step takes (0 included)."""

import itertools

import pytest
import torch

from services.draft import DraftEngine
from services.loop import generate
from services.models import eagle
from services.policy import (
    DECLINED_COST, DECLINED_LOAD, DEFAULT_PROBE_EVERY, AcceptanceCounts, AdaptiveK, CostModel, RequestGate, expected_tokens,
)
from services.sampling import SamplingParams
from tests.conftest import greedy_reference
from tests.services.test_engine import NEW_TOKENS, PROMPTS


def costs(verify_1: float, verify_growth: float, propose_per_token: float, hop: float = 0.0) -> CostModel:
    model = CostModel()
    for n in range(1, 7):
        model.observe_verify(n, verify_1 * (1 + verify_growth * (n - 1)))
    for k in range(1, 6):
        model.observe_propose(k, hop + k * propose_per_token)
    return model


def counts(rates: list[float], steps: int = 1000) -> AcceptanceCounts:
    return AcceptanceCounts(reached=[steps] * len(rates), accepted=[round(steps * r) for r in rates])


def test_expected_tokens():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])


def test_low_acceptance_or_costly_drafts_turn_speculation_off():
    policy = AdaptiveK(costs(40e-3, 0.2, 6e-3, hop=3e-3), counts=counts([0.15, 0.1, 0.05, 0.02]))
    assert policy.choose(remaining=100) == 0


def test_high_acceptance_and_cheap_drafts_draft_several():
    policy = AdaptiveK(costs(40e-3, 0.1, 1e-3), counts=counts([0.9, 0.85, 0.8, 0.8]))
    assert policy.choose(remaining=100) >= 3
    assert policy.choose(remaining=2) == 1  # never more than the budget leaves
    assert policy.choose(remaining=1) == 0


def test_margin_keeps_a_marginal_gain_off():
    """Speculation that would win by less than the margin is not taken (noise must not make it slower than off)."""
    # k = 1: E = 1.2 tokens for 40 * 1.1 + 4 = 48 ms -> 25.0 tok/s vs off 25.0 tok/s
    policy = AdaptiveK(costs(40e-3, 0.1, 4e-3), counts=counts([0.2]), k_max=1)
    assert policy.choose(remaining=100) == 0


def test_off_probes_with_backoff_and_learns_from_requests():
    policy = AdaptiveK(costs(40e-3, 0.2, 6e-3, hop=3e-3), prior=AcceptanceCounts(), counts=counts([0.1, 0.05]), probe_every=4)
    choices = []
    for _ in range(28):
        k = policy.choose(remaining=100)
        choices.append(k)
        policy.observe(k, 0)
    assert [i for i, k in enumerate(choices) if k] == [3, 11, 27]  # waits of 4, 8, 16 steps: failed probes back off
    assert policy.prior.reached[0] == 3  # the driver's estimate for later requests saw the probes


def test_first_step_measures_when_nothing_is_known():
    assert AdaptiveK(CostModel()).choose(remaining=10) == 1


def test_unmeasured_costs_are_extrapolated():
    model = CostModel()
    model.observe_verify(1, 40e-3)
    model.observe_propose(2, 10e-3)
    assert model.verify(3) == pytest.approx(40e-3 * 1.4)
    assert model.propose(4) == pytest.approx(20e-3)
    assert model.step(0) == pytest.approx(40e-3)


class Scripted(AdaptiveK):
    """k from a fixed cycle (still bounded by the budget): every pattern of drafting and not drafting, reproducibly."""

    def __init__(self, pattern):
        super().__init__(CostModel())
        self.pattern = itertools.cycle(pattern)

    def choose(self, remaining: int) -> int:
        return min(next(self.pattern), remaining - 1)


@pytest.fixture(scope="module")
def engines(tiny, tiny_engines):
    target, draft = tiny
    torch.manual_seed(3)
    head = eagle.EagleHead(target.model, eagle.EagleConfig(draft_vocab=64), torch.arange(64), target.config.hidden_size)
    prefill, _, verify = tiny_engines
    return prefill, DraftEngine(draft, eagle_head=head.eval()), verify


@pytest.mark.parametrize("drafter", ["model", "eagle", "prompt_lookup"])
@pytest.mark.parametrize("pattern", [[0, 0, 3, 0, 1, 2], [0, 0, 0, 0, 0, 4], [5, 0]])
def test_greedy_equals_target_alone_whatever_k_each_step_takes(tiny, engines, drafter, pattern):
    target, _ = tiny
    prefill, draft, verify = engines
    for prompt in PROMPTS[:4]:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=5,
                          params=SamplingParams(), drafter=drafter, policy=Scripted(pattern))
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), f"prompt {prompt}"


def test_adaptive_policy_is_lossless_and_measures(tiny, engines):
    target, _ = tiny
    prefill, draft, verify = engines
    policy = AdaptiveK(CostModel(), prior=AcceptanceCounts())
    for prompt in PROMPTS:
        policy = AdaptiveK(policy.costs, prior=policy.prior)
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=4,
                          params=SamplingParams(), drafter="model", policy=policy)
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS)
    assert 1 in policy.costs.verify_s and 1 in policy.costs.propose_s
    assert sum(policy.prior.reached) > 0


def test_an_unmeasured_larger_k_is_tried_now_and_then():
    """k = 2 is only extrapolated (pessimistically, from k = 1 with its stage hop): it is measured every probe_every steps."""
    model = CostModel()
    for n in range(1, 4):
        model.observe_verify(n, 40e-3 * (1 + 0.1 * (n - 1)))
    model.observe_propose(1, 20e-3)  # k = 2 extrapolates to 40 ms
    policy = AdaptiveK(model, counts=counts([0.9, 0.5]), k_max=2, probe_every=4)
    assert [policy.choose(remaining=100) for _ in range(8)] == [1, 1, 1, 2, 1, 1, 1, 2]


def test_the_prior_excludes_the_requests_own_steps():
    prior = AcceptanceCounts()
    policy = AdaptiveK(CostModel(), prior=prior)
    for _ in range(100):
        policy.observe(1, 1)
    # the request's own 100 accepted steps are not counted twice: the prior of "others" is still the default
    assert policy.counts.rate(0, prior) == pytest.approx((100 + 8 * 0.5) / (100 + 8))


def test_hidden_drafting_picks_k_by_verify_cost_alone():
    """Pre-drafting hides the drafter's cost: k >= 1 always, longer blocks only while acceptance repays the verify."""
    costs = CostModel()
    for n, seconds in ((1, 0.040), (2, 0.044), (3, 0.054), (4, 0.066), (5, 0.080)):
        costs.observe_verify(n, seconds)
    costs.observe_propose(1, 10.0)  # a huge proposal cost must not matter
    high, low = AcceptanceCounts(), AcceptanceCounts()
    for _ in range(200):
        high.add(4, 4)
        low.add(4, 0)
    assert AdaptiveK(costs, k_max=4, counts=high).choose_hidden() == 4
    assert AdaptiveK(costs, k_max=4, counts=low).choose_hidden() == 1


def test_per_step_overhead_dilutes_the_cost_of_drafting():
    """A step's fixed overhead (driver, client) counts for every k: with it, a draft that pays is not turned down."""
    costs = CostModel()
    costs.observe_verify(1, 0.040)
    costs.observe_verify(2, 0.044)
    costs.observe_propose(1, 0.020)
    counts = AcceptanceCounts()
    for _ in range(100):
        counts.add(1, 1 if _ % 2 else 0)  # a_1 = 0.5 -> E(1) = 1.5
    policy = AdaptiveK(costs, k_max=1, counts=counts)
    assert policy.choose(64) == 0  # 1.5 / 64 ms < 1 / 40 ms * 1.05
    costs.observe_overhead(0.030)
    assert costs.step(0) == pytest.approx(0.070) and costs.step(1) == pytest.approx(0.094)
    assert policy.choose(64) == 1  # 1.5 / 94 ms > 1 / 70 ms * 1.05


def test_one_slow_call_moves_the_cost_average_little():
    costs = CostModel()
    costs.observe_verify(2, 0.050)
    costs.observe_verify(2, 5.0)  # a pause: counted as twice the average at most
    assert costs.verify(2) == pytest.approx(0.8 * 0.050 + 0.2 * 0.100)


def test_under_load_adaptive_k_drafts_nothing_and_resumes_after():
    """Above max_load requests in flight the verifier batches sessions' tokens instead: k = 0, no probes."""
    load = [1]
    policy = AdaptiveK(costs(0.040, 0.05, 0.002), k_max=4, load=lambda: load[0], max_load=4)
    for _ in range(20):
        policy.observe(3, 3)  # every draft accepted: speculation pays alone
    assert policy.choose(100) >= 2
    load[0] = 5
    assert not any(policy.choose(100) for _ in range(3 * DEFAULT_PROBE_EVERY))
    load[0] = 4
    assert policy.choose(100) >= 2
    unlimited = AdaptiveK(costs(0.040, 0.05, 0.002), k_max=4, load=lambda: 50, max_load=0)
    unlimited.observe(3, 3)
    assert unlimited.choose(100) >= 1


def test_request_gate_serves_without_a_drafter_where_speculation_does_not_pay():
    """Where earlier requests measured no gain, a request starts without a drafter; every explore_every-th such
    request speculates anyway (so the estimates stay fresh); under load none does."""
    gate = RequestGate(explore_every=4)
    assert gate.decline(AdaptiveK(CostModel())) == ""  # nothing measured yet: speculate to learn
    no_gain = AdaptiveK(costs(40e-3, 0.2, 6e-3, hop=3e-3), prior=counts([0.15, 0.1, 0.05, 0.02]))
    assert not no_gain.would_speculate()
    assert [gate.decline(no_gain) for _ in range(8)] == [DECLINED_COST] * 3 + [""] + [DECLINED_COST] * 3 + [""]
    gain = AdaptiveK(costs(40e-3, 0.1, 1e-3), prior=counts([0.9, 0.85, 0.8, 0.8]))
    assert gain.would_speculate() and gate.decline(gain) == ""
    load = [3]
    loaded = AdaptiveK(costs(40e-3, 0.1, 1e-3), prior=counts([0.9, 0.85]), load=lambda: load[0], max_load=2)
    assert {gate.decline(loaded) for _ in range(10)} == {DECLINED_LOAD}
    load[0] = 2
    assert gate.decline(loaded) == ""
    assert {RequestGate(explore_every=1).decline(no_gain) for _ in range(3)} == {""}  # 1: always speculate
