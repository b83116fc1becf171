"""Chained steps (services.chained): a proposal and the verification of its drafts in one engine call."""

import pytest

from services.chained import ChainedCall, ChainedResult, run_chained
from services.draft import DraftEngine, ProposeCall
from services.errors import SessionNotFoundError
from services.loop import generate
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.verify import VerifyCall, VerifyEngine
from tests.conftest import greedy_reference
from tests.services.test_batched_verify import PARAMS, PROMPTS  # greedy and seeded sampled, each its own parameters
from tests.services.test_eagle_drafter import random_head
from tests.services.test_engine import NEW_TOKENS

DRAFTERS = ["eagle", "model", "eagle", "model", "prompt_lookup", "eagle"]


def _same(a, b) -> bool:
    """Two verdicts alike: tokens, matches, path and the features they carry."""
    same_features = (a.features is None and b.features is None) or (
        a.features is not None and b.features is not None and a.features.equal(b.features))
    return (a.token_ids, a.n_matches, a.accepted, a.path) == (b.token_ids, b.n_matches, b.accepted, b.path) and same_features


@pytest.fixture(scope="module")
def twins(tiny):
    """Two (drafter, verifier) pairs with the same models and sessions: one steps apart, one chained."""
    target, draft = tiny
    head, prefill = random_head(target), PrefillEngine(target)
    pairs = [(DraftEngine(draft, eagle_head=head), VerifyEngine(target)) for _ in range(2)]
    for i, (prompt, params, drafter) in enumerate(zip(PROMPTS, PARAMS, DRAFTERS)):
        result = prefill.prefill(prompt, params, features=True)
        for drafts, verifier in pairs:
            drafts.start(f"s{i}", prompt, params, drafter, result.features if drafter == "eagle" else None)
            verifier.open(f"s{i}", result.payload, result.first_token, params, features=True)
    return pairs, prefill


def test_a_chained_pass_equals_propose_then_verify(twins):
    """Six sessions (EAGLE, draft model, prompt lookup; greedy and sampled; chains and a tree) and one plain verify
    call in the same passes, over four steps: every verdict and proposal is the one of the two calls made apart."""
    ((drafts_a, verifier_a), (drafts_b, verifier_b)), _ = twins
    accepts = {i: [(0, PROMPTS[i][-1], None)] for i in range(5)}  # each session's last verdict, for its drafter
    matched = 0
    for step in range(4):
        proposes = [ProposeCall(f"s{i}", k=1 + (i + step) % 3, accepts=accepts[i],
                                width=3 if PARAMS[i].greedy and i % 2 == 0 else 1) for i in range(5)]
        apart = []
        for call in proposes:
            proposal = drafts_a.propose(call.request_id, call.k, accepts=call.accepts, width=call.width)
            verdict = verifier_a.verify(call.request_id, proposal.token_ids, proposal.probs, tree_parents=proposal.parents)
            apart.append((proposal, verdict))
        plain = verifier_a.verify("s5", [])
        got = run_chained(drafts_b, verifier_b, [ChainedCall(c) for c in proposes] + [VerifyCall("s5", [])])
        assert _same(got[-1], plain)
        for i, ((proposal, verdict), result) in enumerate(zip(apart, got)):
            assert isinstance(result, ChainedResult) and result.propose_s > 0 and result.verify_s > 0
            assert result.proposal.token_ids == proposal.token_ids and _same(result.verdict, verdict), (step, i)
            accepts[i] = [(verdict.n_matches, verdict.token_ids[-1], verdict.features)]
            matched += verdict.n_matches
    assert matched > 0  # (rollbacks and accepted drafts both happened)


def test_a_failed_proposal_verifies_no_drafts(twins):
    """A proposal that fails (its draft session is gone) fails alone: its step verifies no drafts, the error in
    its result; the other calls of the pass are answered."""
    (_, (drafts, verifier)), _ = twins
    drafts.close("s5")
    got = run_chained(drafts, verifier, [ChainedCall(ProposeCall("s5", k=2)), VerifyCall("s1", [])])
    assert isinstance(got[0].proposal, SessionNotFoundError)
    assert len(got[0].verdict.token_ids) == 1 and got[0].verdict.n_matches == 0
    assert not isinstance(got[1], Exception)


@pytest.mark.parametrize("drafter,k,width", [("model", 2, 1), ("eagle", 1, 3), ("eagle", 3, 1)])
def test_the_chained_loop_equals_target_alone(tiny, drafter, k, width):
    """SpeculativeLoop(chained=True), driven in-process: greedy output is the target's alone, with the same steps
    and acceptance as the loop that proposes and verifies in two rounds."""
    target, draft = tiny
    engines = PrefillEngine(target), DraftEngine(draft, eagle_head=random_head(target)), VerifyEngine(target)
    for prompt in PROMPTS:
        results = [generate(*engines, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k, params=SamplingParams(),
                            drafter=drafter, tree_width=width, chained=chained) for chained in (False, True)]
        assert results[1].token_ids == results[0].token_ids == greedy_reference(target.model, prompt, NEW_TOKENS)
        assert (results[1].stats.steps, results[1].stats.accepted) == (results[0].stats.steps, results[0].stats.accepted)


def test_a_pinned_loop_records_its_costs(tiny):
    """A loop without a policy (k pinned) records its step costs where the driver asks (the verify replica keeps
    them per drafter: the policy of later requests, and bench grpc's fastest proposal)."""
    from services.loop import SpeculativeLoop, drive
    from services.policy import CostModel

    target, draft = tiny
    prefill, drafts, verifier = PrefillEngine(target), DraftEngine(draft), VerifyEngine(target)
    prompt, params = PROMPTS[0], SamplingParams()
    result = prefill.prefill(prompt, params)
    drafts.start("pinned", prompt, params, "model")
    verifier.open("pinned", result.payload, result.first_token, params)
    costs = CostModel()
    loop = SpeculativeLoop(result.first_token, max_new_tokens=16, eos=set(), num_draft_tokens=2, drafting=True,
                           chained=True, costs=costs)
    tokens = [t for step in drive(loop, drafts, verifier, "pinned") for t in step.token_ids]
    assert tokens == greedy_reference(target.model, prompt, 16)
    assert 2 in costs.propose_s and costs.min_propose_s[2] <= costs.propose_s[2] and 3 in costs.verify_s
