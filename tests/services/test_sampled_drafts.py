"""Sampled requests get sampled drafts: at temperature > 0 every drafter kind proposes a chain (never a tree, even
when the request's policy asks for one) whose tokens are drawn from the drafter's own q, and hands that q to the
verifier (None only where q is one-hot: a lookup), so rejection sampling stays exact (not argmax drafts under a
sampled q: vllm#16899)."""

import pytest
import torch

from services import drafters
from services.draft import DraftEngine
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from tests.services.test_eagle_drafter import random_head
from tests.services.test_hybrid_drafter import REPEATING

PROMPT = [1, 40, 41, 42, 43, 44, 45]  # no repeat: lookup finds nothing, the hybrid drafts with its head
NEXT = 50  # the token after the prompt, fixed (a sampled first token that repeated one of PROMPT's would be a lookup)
DRAWS = 400


@pytest.fixture(scope="module")
def engines(tiny):
    target, draft = tiny
    return PrefillEngine(target), DraftEngine(draft, eagle_head=random_head(target))


def proposals(engines, kind: str, prompt: list[int], params: SamplingParams, n: int, k: int = 3, width: int = 3):
    prefill, draft = engines
    handoff = prefill.prefill(prompt, params, features=drafters.reads_features(kind))
    out = []
    for i in range(n):
        draft.start(f"s{i}", prompt, SamplingParams(params.temperature, params.top_k, params.top_p, seed=i), kind,
                    handoff.features)
        draft.accept(f"s{i}", 0, NEXT)
        out.append(draft.propose(f"s{i}", k, width=width))
        draft.close(f"s{i}")
    return out


@pytest.mark.parametrize("kind", ["model", "eagle", "hybrid"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_drafts_are_drawn_from_the_drafters_own_q(engines, kind, temperature):
    params = SamplingParams(temperature=temperature)
    drawn = proposals(engines, kind, PROMPT, params, DRAWS)
    for p in drawn:
        assert p.parents is None and len(p.token_ids) == 3  # a chain, though width 3 was asked
        q = p.probs  # [k, vocab_size]
        assert q is not None and q.shape[0] == 3
        torch.testing.assert_close(q.sum(-1), torch.ones(3), rtol=0, atol=1e-4)
        assert all(q[i, t] > 0 for i, t in enumerate(p.token_ids))  # each token is in its row's support
    # the first token's q is the same for every seed (same context): the draws follow it, not its argmax
    q0 = drawn[0].probs[0]
    counts = torch.bincount(torch.tensor([p.token_ids[0] for p in drawn]), minlength=q0.shape[0]).float() / DRAWS
    assert len({p.token_ids[0] for p in drawn}) > 1 or q0.max() > 0.99
    assert 0.5 * (counts - q0).abs().sum() < 0.15  # total variation of 400 draws from q0


def test_a_lookup_proposal_is_one_hot(engines):
    """Where the hybrid's context repeats, its sampled step proposes the lookup's chain with q one-hot (None)."""
    prefill, draft = engines
    params = SamplingParams(temperature=1.0, seed=0)
    draft.start("l", REPEATING, params, "hybrid", prefill.prefill(REPEATING, params, features=True).features)
    draft.accept("l", 0, 23)  # the token after the prompt continues the repeat
    p = draft.propose("l", 3, width=3)
    draft.close("l")
    assert (p.token_ids, p.probs, p.parents) == ([24, 25, 26], None, None)
