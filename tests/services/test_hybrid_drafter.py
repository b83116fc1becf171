"""The hybrid drafter (services.hybrid_draft): prompt lookup where the text repeats, the EAGLE head elsewhere, one
session. Greedy output stays the target's, lookups are taken where the context repeats, and the head keeps
drafting after them (its features of the accepted lookup tokens come with the verdicts)."""

import pytest

from services import drafters
from services.constraint import DraftGrammar
from services.draft import DraftEngine
from services.drafters import DraftProposal, check_accept, drive
from services.hybrid_draft import HybridSession, merged_tree
from services.loop import generate
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.tree import chain_length
from services.verify import VerifyEngine
from tests.conftest import greedy_reference
from tests.services.test_eagle_drafter import random_head
from tests.services.test_engine import NEW_TOKENS, PROMPTS

REPEATING = [1, 20, 21, 22, 23, 24, 25, 26, 20, 21, 22, 23, 24, 25, 26, 20, 21, 22]  # a span the answer may copy


@pytest.fixture(scope="module")
def engines(tiny):
    target, draft = tiny
    return PrefillEngine(target), DraftEngine(draft, eagle_head=random_head(target)), VerifyEngine(target)


def test_registered_and_offered_with_a_head(engines):
    assert drafters.kinds()["hybrid"].reads_features and drafters.kinds()["hybrid"].needs == "head"
    assert "hybrid" in engines[1].drafters


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_equals_target_alone(tiny, engines, k):
    target, _ = tiny
    prefill, draft, verify = engines
    drafted = 0
    for prompt in [*PROMPTS, REPEATING]:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                          params=SamplingParams(), drafter="hybrid")
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), f"prompt {prompt}"
        drafted += result.stats.drafted
    assert drafted > 0


def test_a_repeating_context_is_drafted_by_lookup_then_by_the_head(engines):
    """On a context that repeats, a step proposes what followed the earlier occurrence (the greedy test above has
    the head draft again after such steps, from the accepted tokens' features)."""
    prefill, draft, _ = engines
    params = SamplingParams()
    result = prefill.prefill(REPEATING, params, features=True)
    draft.start("h", REPEATING, params, "hybrid", result.features)
    draft.accept("h", 0, 23)  # the token after the prompt continues the repeat (its feature: with the next verdict)
    proposal = draft.propose("h", 3)  # greedy: what followed "22 23" earlier, as prompt lookup has it, is the chain
    assert proposal.token_ids[:3] == [24, 25, 26] and proposal.parents[:3] == [0, 1, 2]
    assert len(proposal.token_ids) > 3  # and the head's chain beside it (where it is not the lookup's)
    assert 1 + len(proposal.token_ids) <= drafters.get("hybrid").verify_rows(3, 1)  # the rows a pass plans for
    draft.close("h")


def test_merged_tree_shares_the_nodes_where_lookup_and_head_agree():
    """The lookup chain first; the head's nodes beside it, but where one is the chain's next token it is that node."""
    # head chain 7 8 5 agrees with the lookup's 7 8 then leaves it; its side node 6 (a child of the pending token)
    ids, parents = merged_tree([7, 8, 9], [7, 8, 5, 6], [0, 1, 2, 0])
    assert (ids, parents) == ([7, 8, 9, 5, 6], [0, 1, 2, 2, 0])
    ids, parents = merged_tree([7, 8], [4, 5, 6], [0, 1, 2])  # no agreement: a second chain from the pending token
    assert (ids, parents) == ([7, 8, 4, 5, 6], [0, 1, 0, 3, 4])
    assert merged_tree([7, 8], [7, 8], [0, 1]) == ([7, 8], [0, 1])


@pytest.mark.parametrize("width", [1, 3])
def test_greedy_merged_trees_equal_target_alone(tiny, engines, width):
    """A repeating context drafts lookup and head in one tree (the head's chain, or its own tree, beside the lookup's
    chain): the output is the target's."""
    target, _ = tiny
    prefill, draft, verify = engines
    for prompt in [REPEATING, REPEATING[:9] + [30, 31] + REPEATING[1:6]]:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=3,
                          params=SamplingParams(), drafter="hybrid", tree_width=width)
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), f"prompt {prompt}"


class _AgreeingHead:
    """An EAGLE session's stand-in whose greedy chain is fixed: it agrees with a short lookup and goes on after it."""

    def __init__(self, tokens, chain):
        self.tokens, self.chain, self.proposal = list(tokens), chain, []
        self.params, self.grammar = SamplingParams(), DraftGrammar(None)

    def propose_steps(self, k, forced=(), width=1):
        self.proposal = list(forced) + self.chain
        return DraftProposal(list(self.chain), None)
        yield  # noqa: unreachable - a generator, as the protocol's steps are

    def accept(self, n_matches, next_token, features=None):
        self.tokens += check_accept(self.proposal, n_matches) + [next_token]


def test_a_lookup_shorter_than_k_that_the_head_continues_is_accepted_whole():
    """The context's latest match is 2 tokens before its end: the lookup has 2 tokens for k = 3, the head agrees with
    them and drafts a third. The merged tree's chain is the 3 tokens; a verdict that accepts all of them is taken
    (it was refused: the session counted only the lookup's 2 as its proposal)."""
    tokens = [1, 30, 31, 30, 31, 30, 31]  # "31 30 31" last occurred at 2: what followed it is [30, 31]
    session = HybridSession(_AgreeingHead(tokens, [30, 31, 40]))
    proposal = drive(session.propose_steps(3), lambda _: None)
    assert proposal.token_ids == [30, 31, 40] and chain_length(proposal.parents) == 3
    session.accept(3, 41)
    assert session.eagle.tokens == tokens + [30, 31, 40, 41]
