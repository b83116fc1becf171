"""Batched drafting (DraftEngine.propose_batch): each session's proposal is the one it gets alone."""

import pytest
import torch

from services.draft import DraftEngine, ProposeCall
from services.errors import InvalidRequestError, SessionNotFoundError
from services.models.tiny import TINY_VOCAB_SIZE
from services.prefill import PrefillEngine
from tests.services.test_batched_verify import PARAMS  # greedy and seeded sampled, each its own parameters
from tests.services.test_eagle_drafter import random_head

PROMPTS = [[1, 5, 7, 9, 11], [1, 20], [1, 30, 31, 32, 30, 31], [2, 3], [1, 40, 41, 42, 43, 44, 45, 46], [1, 9, 9, 9]]
DRAFTERS = ["eagle", "model", "eagle", "model", "eagle", "prompt_lookup"]
STEPS = 6


@pytest.fixture(scope="module")
def twins(tiny):
    """Two draft engines with the same models and the same sessions: one proposes alone, one in batches."""
    target, draft = tiny
    head, prefill = random_head(target), PrefillEngine(target)
    engines = DraftEngine(draft, eagle_head=head), DraftEngine(draft, eagle_head=head)
    for i, (prompt, params, drafter) in enumerate(zip(PROMPTS, PARAMS, DRAFTERS)):
        features = prefill.prefill(prompt, params, features=True).features if drafter == "eagle" else None
        for engine in engines:
            engine.start(f"s{i}", prompt, params, drafter, features)
    return engines, target.config.hidden_size


def _verdict(i: int, step: int, proposal: list[int], hidden: int):
    """A made-up verdict on a proposal: some drafts accepted (rollback of the rest), then a token, with features."""
    n = min(len(proposal), (i + step) % 3)
    token = (7 * i + 11 * step) % (TINY_VOCAB_SIZE - 3) + 3
    features = torch.randn(n + 1, hidden, generator=torch.Generator().manual_seed(100 * i + step)).bfloat16()
    return n, token, features


def _equal(a, b) -> bool:
    return a.token_ids == b.token_ids and (
        (a.probs is None and b.probs is None) or (a.probs is not None and b.probs is not None and torch.equal(a.probs, b.probs))
    )


def test_batched_proposals_equal_proposals_alone(twins):
    """Six sessions (EAGLE, draft model, prompt lookup; greedy and seeded sampled; k = 1..4 varying per step) over
    six steps, each catching up with its own verdict (own rollback): every batched proposal equals the one alone."""
    (alone, batched), hidden = twins
    verdicts = {i: [(0, 3 + i, None)] for i in range(len(PROMPTS))}  # prefill's token (its feature comes with the next)
    drafted = 0
    for step in range(STEPS):
        calls = [ProposeCall(f"s{i}", k=1 + (i + step) % 4, accepts=list(verdicts[i])) for i in range(len(PROMPTS))]
        expected = [alone.propose(c.request_id, c.k, accepts=c.accepts) for c in calls]
        got = batched.propose_batch(calls)
        for i, (want, have) in enumerate(zip(expected, got)):
            assert not isinstance(have, Exception), have
            assert _equal(want, have), (step, i, want.token_ids, have.token_ids)
            verdicts[i] = [_verdict(i, step, want.token_ids, hidden)]
            drafted += len(want.token_ids)
    assert drafted > 0
    passes = batched.batch_passes
    assert passes["eagle"] >= 1 and passes["model"] >= 1  # shared passes ran for both model kinds


def test_pre_drafts_and_forced_tokens_join_a_batch(twins):
    """Pre-drafts (guesses) and proposals after forced tokens run in the same call as plain proposals."""
    (alone, batched), hidden = twins
    for engine in (alone, batched):
        for i in range(3):
            engine.start(f"p{i}", PROMPTS[i], PARAMS[i], "eagle", _prompt_features(i, hidden))
    first = [(0, 5, None)]  # prefill's token
    calls = [ProposeCall("p0", k=2, forced=[5, 6], guesses=2, accepts=first), ProposeCall("p1", k=3, forced=[4], accepts=first),
             ProposeCall("p2", k=2, accepts=first)]
    expected = [alone.propose(c.request_id, c.k, c.forced, c.guesses, c.accepts) for c in calls]
    got = batched.propose_batch(calls)
    assert all(not isinstance(g, Exception) for g in got), got
    assert [(b.n_matches, b.next_token, b.token_ids) for b in got[0].branches] == \
        [(b.n_matches, b.next_token, b.token_ids) for b in expected[0].branches]
    assert _equal(expected[1], got[1]) and _equal(expected[2], got[2])


def _prompt_features(i: int, hidden: int) -> torch.Tensor:
    return torch.randn(len(PROMPTS[i]), hidden, generator=torch.Generator().manual_seed(i)).bfloat16()


def test_a_bad_call_fails_alone(twins):
    """Unknown session, bad k, an accept beyond the proposal, forced ids out of range, a second call of one session:
    each gets its typed error in its own slot; the other calls are answered as alone."""
    (alone, batched), hidden = twins
    for engine in (alone, batched):
        for i in range(5):
            drafter = DRAFTERS[i % 2]
            engine.start(f"b{i}", PROMPTS[i], PARAMS[i], drafter, _prompt_features(i, hidden) if drafter == "eagle" else None)
    good = [ProposeCall("b0", k=2, accepts=[(0, 4, None)]), ProposeCall("b1", k=1, accepts=[(0, 4, None)])]
    expected = [alone.propose(c.request_id, c.k, accepts=c.accepts) for c in good]
    got = batched.propose_batch([
        ProposeCall("nobody", k=1), good[0], ProposeCall("b2", k=0), ProposeCall("b3", k=1, accepts=[(5, 3, None)]),
        good[1], ProposeCall("b4", k=1, forced=[10**6]), ProposeCall("b0", k=1),
    ])
    assert isinstance(got[0], SessionNotFoundError)
    assert all(isinstance(got[j], InvalidRequestError) for j in (2, 3, 5, 6)), got
    assert _equal(expected[0], got[1]) and _equal(expected[1], got[4])
