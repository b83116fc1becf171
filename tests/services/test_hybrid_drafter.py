"""The hybrid drafter (services.hybrid_draft): prompt lookup where the text repeats, the EAGLE head elsewhere, one
session. Greedy output stays the target's, lookups are taken where the context repeats, and the head keeps
drafting after them (its features of the accepted lookup tokens come with the verdicts)."""

import pytest

from services import drafters
from services.draft import DraftEngine
from services.loop import generate
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
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
    assert draft.propose("h", 3).token_ids == [24, 25, 26]  # what followed "22 23" earlier, as prompt lookup has it
    draft.close("h")
