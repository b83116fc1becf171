"""Pruned draft vocabulary (FR-Spec): the ranking, the pruned heads, and losslessness with a pruned drafter."""

import json

import pytest
import torch

from services import draft_vocab
from services.draft import DraftEngine
from services.draft_vocab import FULL_VOCAB, DraftVocab, scatter_kept
from services.hf_runner import ModelRunner
from services.loading import load_causal_lm
from services.loop import generate
from services.models.tiny import TINY_VOCAB_SIZE
from services.prefill import PrefillEngine
from services.runner import make_runner
from services.sampling import SamplingParams
from services.training.vocab import count_frequencies, rank_ids
from services.verify import VerifyEngine
from tests.conftest import greedy_reference
from tests.services.test_engine import NEW_TOKENS, PROMPTS

N_KEPT = 40  # of the tiny pair's 96 ids


def tiny_vocab(seed: int = 0) -> DraftVocab:
    """A ranking of the tiny vocabulary in a fixed random order, keeping N_KEPT ids by default."""
    order = torch.randperm(TINY_VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))
    return DraftVocab(tuple(order.tolist()), N_KEPT)


@pytest.fixture(scope="module")
def pruned_engines(tiny):
    target, draft = tiny
    return PrefillEngine(target), DraftEngine(draft, vocab=tiny_vocab()), VerifyEngine(target)


def test_rank_by_count_then_lower_id():
    """Most frequent first; ids never seen follow in id order (BPE merge order)."""
    counts = count_frequencies([[5, 5, 2, 7], [7, 5]], vocab_size=8)
    assert counts.tolist() == [0, 0, 1, 0, 0, 3, 0, 2]
    assert rank_ids(counts).tolist() == [5, 7, 2, 0, 1, 3, 4, 6]


def test_kept_ids_are_a_sorted_prefix_of_the_ranking():
    vocab = DraftVocab((9, 3, 7, 1), default_size=3)
    assert vocab.kept_ids().tolist() == [3, 7, 9]
    assert vocab.kept_ids(2).tolist() == [3, 9]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        vocab.kept_ids(5)


def test_scatter_kept_puts_minus_infinity_outside():
    full = scatter_kept(torch.tensor([[1.0, 2.0]]), torch.tensor([1, 3]), 5)  # [1, 5]
    assert full.tolist() == [[-float("inf"), 1.0, -float("inf"), 2.0, -float("inf")]]


@pytest.mark.parametrize("fast", [True, False])
def test_pruned_head_equals_full_head_on_kept_ids(tiny, fast):
    """Compact forward and transformers fallback: the kept ids' logits are the full head's, the rest -inf."""
    _, draft = tiny
    kept = tiny_vocab().kept_ids()
    ids = torch.tensor([1, 5, 7, 9, 11])
    full = make_runner(draft, fast=fast)
    pruned = make_runner(draft, fast=fast, kept_ids=kept)
    assert isinstance(pruned, ModelRunner) != fast
    expected = full.forward(ids, full.new_cache())  # [5, V]
    got = pruned.forward(ids, pruned.new_cache())  # [5, V]
    torch.testing.assert_close(got[:, kept], expected[:, kept], rtol=1e-5, atol=1e-5)
    outside = torch.ones(TINY_VOCAB_SIZE, dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(got[:, outside]).all()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_pruned_drafter_greedy_equals_target_alone(tiny, pruned_engines, k):
    """Greedy with the pruned drafter is token-identical to the target alone, which emits ids outside the kept set."""
    target, _ = tiny
    prefill, draft, verify = pruned_engines
    kept, emitted_outside = set(draft.kept_ids.tolist()), 0
    for prompt in PROMPTS:
        expected = greedy_reference(target.model, prompt, NEW_TOKENS)
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k, params=SamplingParams())
        assert result.token_ids == expected, f"prompt {prompt}"
        emitted_outside += sum(t not in kept for t in expected)
    assert emitted_outside > 0


def test_pruned_drafter_samples_only_kept_ids(pruned_engines):
    """Sampled drafting: q is a full-vocabulary distribution, zero outside the kept ids."""
    _, draft, _ = pruned_engines
    kept = draft.kept_ids
    draft.start("q", PROMPTS[0], SamplingParams(temperature=1.0, seed=3))
    proposal = draft.propose("q", 4)
    draft.close("q")
    assert proposal.probs.shape == (4, TINY_VOCAB_SIZE)
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(4))
    outside = torch.ones(TINY_VOCAB_SIZE, dtype=torch.bool)
    outside[kept] = False
    assert (proposal.probs[:, outside] == 0).all()
    assert set(proposal.token_ids) <= set(kept.tolist())


def test_drafter_folder_ships_its_vocabulary(tiny, tmp_path):
    """A draft_vocab.json beside the weights prunes the head; FULL_VOCAB or no file keeps it whole."""
    _, draft = tiny
    draft.model.save_pretrained(tmp_path / "with")
    draft.model.save_pretrained(tmp_path / "without")
    report = {"default_size": N_KEPT, "ranked_ids": list(tiny_vocab().ranked_ids)}
    draft_vocab.save(report, tmp_path / "with" / draft_vocab.DRAFT_VOCAB_FILE)
    assert json.loads((tmp_path / "with" / draft_vocab.DRAFT_VOCAB_FILE).read_text()) == report
    shipped, plain = load_causal_lm(tmp_path / "with"), load_causal_lm(tmp_path / "without")
    assert DraftEngine(shipped).kept_ids.tolist() == tiny_vocab().kept_ids().tolist()
    assert DraftEngine(shipped, draft_vocab_size=8).kept_ids.numel() == 8
    assert DraftEngine(shipped, draft_vocab_size=FULL_VOCAB).kept_ids is None
    assert DraftEngine(plain).kept_ids is None  # bring-your-own drafter: full head
    with pytest.raises(ValueError, match="no draft_vocab.json"):
        DraftEngine(plain, draft_vocab_size=8)
