"""Draft trees (services.tree): a tree's rows score bit for bit what the same tokens decoded as a sequence score, and
greedy output with trees equals the target alone (model and EAGLE drafters); sampled requests draft chains."""

import pytest
import torch

from services import kernels
from services.errors import InvalidRequestError
from services.loop import drafter_accepts, generate
from services.runner import make_runner
from services.sampling import SamplingParams
from services.tree import DraftTree, chain_length, side_tree, side_widths, tree_rows, with_sides
from services.verify import VerifyEngine, VerifyResult
from tests.conftest import greedy_reference
from tests.services.test_engine import NEW_TOKENS, PROMPTS

PARENTS = (0, 0, 1, 2, 3, 0)  # rows 1 and 2 and 6 under the pending token, 3 under 1, 4 under 2, 5 under 3


def _path(parents, row: int) -> list[int]:
    path = []
    while row:
        path.append(row)
        row = parents[row - 1]
    return [0] + path[::-1]


def test_tree_shape():
    tree = DraftTree(PARENTS)
    assert tree.depths() == [0, 1, 1, 2, 2, 3, 1]
    assert tree.ancestors()[5].tolist() == [True, True, False, True, False, True, False]
    assert not tree.is_chain and DraftTree((0, 1, 2)).is_chain
    assert side_tree(2, 3) == [0, 1, 0, 0, 1, 1]
    assert with_sides([5, 6], [[7], [8]]) == ([5, 6, 7, 8], [0, 1, 0, 1])
    for bad in [(1,), (0, 2), (0, -1)]:
        with pytest.raises(InvalidRequestError):
            DraftTree.checked(bad, len(bad))


def test_drafters_put_side_nodes_at_the_first_depth_only(tiny):
    """A proposal of k drafts and width w: the chain, then w - 1 side nodes at the first depth (children of the
    pending token), none deeper — k + w rows to verify (``tree_rows``), for the model drafter and EAGLE alike."""
    from services.draft import DraftEngine
    from services.prefill import PrefillEngine
    from tests.services.test_eagle_drafter import random_head

    assert side_widths(3, 3) == [2, 0, 0] and side_widths(1, 4) == [3] and side_widths(0, 3) == []
    assert [tree_rows(k, 3) for k in range(4)] == [1, 4, 5, 6] and tree_rows(2, 1) == 3
    target, draft = tiny
    prefill, drafts = PrefillEngine(target), DraftEngine(draft, eagle_head=random_head(target))
    prompt = [1, 5, 7, 9]
    result = prefill.prefill(prompt, SamplingParams(), features=True)
    for drafter in ("model", "eagle"):
        drafts.start(drafter, prompt, SamplingParams(), drafter, result.features)
        drafts.accept(drafter, 0, result.first_token)
        proposal = drafts.propose(drafter, 3, width=3)
        assert proposal.parents == [0, 1, 2, 0, 0], (drafter, proposal.parents)
        assert len(proposal.token_ids) == tree_rows(3, 3) - 1
        assert len(set(proposal.token_ids[:1] + proposal.token_ids[3:])) == 3  # the first depth's 3 candidates
        drafts.close(drafter)


@pytest.mark.parametrize("compiled", [True, False], ids=["decode_attention", "sdpa"])
def test_tree_rows_score_what_their_paths_score_as_sequences(tiny, monkeypatch, compiled):
    """Each tree row's logits and features are those of its path decoded as a sequence: bit for bit through the
    compiled attention (the same keys in the same order), to float rounding through SDPA's masked attention."""
    target, _ = tiny
    if compiled and kernels.decode_attention() is None:
        pytest.skip("the compiled kernels are not available on this machine")
    if not compiled:
        monkeypatch.setattr(kernels, "decode_attention", lambda: None)
    runner = make_runner(target)
    assert runner.supports_trees
    context, tokens = torch.arange(3, 40), torch.tensor([7, 50, 60, 70, 80, 90, 95])  # row 0: the pending token
    cache = runner.new_cache()
    runner.forward(context, cache)
    start = cache.seq_len
    (logits,), (features,) = runner.forward_batch([(tokens, cache)], trees=[DraftTree(PARENTS)])
    for row in range(1, len(tokens)):
        alone = runner.new_cache()
        runner.forward(context, alone)
        (seq_logits,), (seq_features,) = runner.forward_batch([(tokens[_path(PARENTS, row)], alone)])
        if compiled:
            assert torch.equal(seq_logits[-1], logits[row]) and torch.equal(seq_features[-1], features[row]), row
        else:
            torch.testing.assert_close(seq_logits[-1], logits[row], rtol=1e-4, atol=1e-4)
    # keeping a path leaves the KV of that path as a sequence
    cache.keep(start, [0, 2, 4])
    sequence = runner.new_cache()
    runner.forward(context, sequence)
    runner.forward(tokens[[0, 2, 4]], sequence)
    assert cache.seq_len == sequence.seq_len
    kept, expected = cache.buffer[..., : cache.seq_len, :], sequence.buffer[..., : sequence.seq_len, :]
    if compiled:
        assert torch.equal(kept, expected)
    else:  # a pass over 7 rows and one over 3 round differently (matmul blocking): one value in 10,240 was 7e-6 off
        torch.testing.assert_close(kept, expected, rtol=1e-4, atol=1e-4)  # a wrong row kept is off by O(1)


@pytest.mark.parametrize("k,width", [(1, 3), (2, 2), (3, 3), (4, 2)])
def test_greedy_with_trees_equals_target_alone(tiny, tiny_engines, k, width):
    target, _ = tiny
    prefill, draft, verify = tiny_engines
    side_hits = 0
    original = verify.verify_batch

    def watched(calls):
        nonlocal side_hits
        results = original(calls)
        side_hits += sum(1 for call, r in zip(calls, results) if r.path and r.path[-1] > chain_length(call.tree_parents))
        return results

    verify.verify_batch = watched
    try:
        for prompt in PROMPTS:
            result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                              params=SamplingParams(), drafter="model", tree_width=width)
            assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), prompt
            assert result.stats.drafted > 0
    finally:
        verify.verify_batch = original
    assert side_hits > 0, "no step accepted a side node: the tree's own path was not exercised"


def test_eagle_trees_on_the_default_pair(default_pair):
    """The EAGLE head's trees accept more tokens a step than its chains, with the target's exact greedy tokens."""
    from services.draft import DraftEngine
    from services.eagle_draft import installed_head
    from services.prefill import PrefillEngine
    from splitspec.bench.engine import chat_ids, held_out_prompts

    target, draft = default_pair
    prefill, verify = PrefillEngine(target), VerifyEngine(target)
    drafts = DraftEngine(draft, eagle_head=installed_head(draft, target))
    lengths = {}
    for width in (1, 3):
        accepted = steps = 0
        for prompt in held_out_prompts()[:2]:
            ids = chat_ids(target.tokenizer, prompt)
            result = generate(prefill, drafts, verify, ids, max_new_tokens=32, num_draft_tokens=2,
                              params=SamplingParams(), drafter="eagle", tree_width=width)
            assert result.token_ids == greedy_reference(target.model, ids, 32), prompt
            accepted, steps = accepted + result.stats.accepted, steps + result.stats.steps
        lengths[width] = (accepted + steps) / steps
    assert lengths[3] > lengths[1], lengths


def test_sampled_requests_draft_chains(tiny_engines):
    """A tree width does not change a sampled request: its proposals are chains and its seeded answer is the same."""
    prefill, draft, verify = tiny_engines
    params = SamplingParams(temperature=0.8, seed=3)
    answers = [generate(prefill, draft, verify, PROMPTS[0], max_new_tokens=32, num_draft_tokens=2, params=params,
                        drafter="model", tree_width=width).token_ids for width in (1, 3)]
    assert answers[0] == answers[1]


def test_verify_refuses_a_tree_for_a_sampled_session(tiny, tiny_engines):
    prefill, _, verify = tiny_engines
    result = prefill.prefill([1, 5, 7], SamplingParams(temperature=1.0, seed=1))
    verify.open("tree-sampled", result.payload, result.first_token, SamplingParams(temperature=1.0, seed=1))
    try:
        with pytest.raises(InvalidRequestError, match="greedily"):
            verify.verify("tree-sampled", [5, 6], torch.full((2, verify.target.vocab_size), 1.0 / verify.target.vocab_size),
                          tree_parents=(0, 0))
        with pytest.raises(InvalidRequestError, match="parents"):
            verify.verify("tree-sampled", [5, 6], None, tree_parents=(0, 2))
    finally:
        verify.close("tree-sampled")


def test_a_forward_without_trees_verifies_the_chain(tiny, tiny_engines):
    """transformers' forward (the GPU path) takes no tree mask: greedy requests with trees still get the target's
    tokens, each tree verified as its chain."""
    target, _ = tiny
    prefill, draft, _ = tiny_engines
    verify = VerifyEngine(target, fast=False)
    assert not verify.runner.supports_trees
    for prompt in PROMPTS[:3]:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=32, num_draft_tokens=2,
                          params=SamplingParams(), drafter="model", tree_width=3)
        assert result.token_ids == greedy_reference(target.model, prompt, 32), prompt


def test_drafter_takes_a_path_off_the_chain_node_by_node():
    """The drafter proposed the chain; a verdict whose path leaves it (a side node, or a branch of several nodes) is
    the chain's accepted tokens, then each node off the chain, then the bonus token, each with its features."""
    features = torch.arange(5.0)[:, None]  # [n_matches + 1, 1]
    # chain rows 1-3; a branch 4 -> 5 from row 1: the path 1, 4, 5 accepts 3 tokens, then the bonus 9
    verdict = VerifyResult([11, 14, 15, 9], 3, [True] * 3, features[:4], [1, 4, 5])
    got = drafter_accepts(verdict, chain=3)
    assert [(a.n_matches, a.next_token) for a in got] == [(1, 14), (0, 15), (0, 9)]
    assert [a.features.flatten().tolist() for a in got] == [[0.0, 1.0], [2.0], [3.0]]
    along = VerifyResult([11, 12, 9], 2, [True, True, False], features[:3], [1, 2])
    assert [(a.n_matches, a.next_token) for a in drafter_accepts(along, chain=3)] == [(2, 9)]
    chain = VerifyResult([11, 9], 1, [True, False], None, None)
    assert [(a.n_matches, a.next_token) for a in drafter_accepts(chain, chain=2)] == [(1, 9)]
