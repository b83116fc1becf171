"""The default SmolLM2 pair: prepared offline, and greedy output identical to the target alone."""

import pytest

from services.draft import DraftEngine
from services.eagle_draft import installed_head
from services.loop import generate
from services.models.prompts import held_out_prompts
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.text import chat_ids
from services.verify import VerifyEngine
from tests.conftest import greedy_reference

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def engines(default_pair):
    target, draft = default_pair
    return PrefillEngine(target), DraftEngine(draft, eagle_head=installed_head(draft, target)), VerifyEngine(target)


@pytest.fixture(scope="module")
def prompts(default_pair):
    target, _ = default_pair
    return [chat_ids(target.tokenizer, p) for p in held_out_prompts()[:NUM_PROMPTS]]


def test_the_eagle_head_keeps_the_draft_vocabulary(engines):
    """The shipped EAGLE head keeps as many ids as the draft vocabulary (8192 by default), of the 16384 it was
    trained with: its LM head streams half the rows (the greedy tests below run with it)."""
    _, draft, _ = engines
    kept = draft.eagle_head.kept_ids
    assert len(draft.kept_ids) == len(kept) == 8192


def test_pair_is_a_real_model(default_pair):
    """The GGUF-derived target answers correctly: it writes an is_prime function."""
    target, _ = default_pair
    ids = chat_ids(target.tokenizer, "Write a Python function is_prime(n) that checks whether n is prime.")
    text = target.tokenizer.decode(greedy_reference(target.model, ids, 48))
    assert "def is_prime" in text


# (the model drafter, and EAGLE's shortest and longest k; every drafter kind, pinned and adaptive k, runs through the
# graph on the same pair in both layouts: tests/serving/test_colocated.py and test_greedy.py)
@pytest.mark.parametrize("drafter,k", [("model", 3), ("eagle", 1), ("eagle", 5)])
def test_greedy_equals_target_alone(default_pair, engines, prompts, drafter, k):
    """8 prompts x 64 tokens: token-identical to generate(do_sample=False) of the target."""
    target, _ = default_pair
    prefill, draft, verify = engines
    for ids in prompts:
        result = generate(prefill, draft, verify, ids, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                          params=SamplingParams(), drafter=drafter)
        assert result.token_ids == greedy_reference(target.model, ids, NEW_TOKENS)


def test_drafter_head_keeps_the_shipped_draft_vocabulary(default_pair, engines):
    """`models prepare` installs the shipped FR-Spec ranking, so the tests above run the pruned drafter."""
    from services.draft_vocab import load
    from services.models.default_pair import SHIPPED_DRAFT_VOCAB

    _, draft, _ = engines
    shipped = load(SHIPPED_DRAFT_VOCAB)
    assert draft.kept_ids.tolist() == shipped.kept_ids().tolist()
    assert draft.kept_ids.numel() == shipped.default_size < default_pair[1].vocab_size


def test_prepare_installs_the_shipped_eagle_head(default_pair, engines):
    """`models prepare` puts the shipped EAGLE head beside the drafter, so the pair offers every drafter kind."""
    _, draft, _ = engines
    assert draft.drafters == ("model", "prompt_lookup", "eagle", "hybrid")
    assert draft.eagle_head.cfg.feature == "final"
