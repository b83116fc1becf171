"""The drafter registry (services.drafters): one protocol, kinds by name, a new kind in one module."""

import pytest

from services import drafters
from services.draft import DraftEngine
from services.errors import InvalidRequestError
from services.sampling import SamplingParams


def test_the_built_in_kinds_are_registered_with_what_they_need():
    kinds = drafters.kinds()
    assert {"model", "eagle", "prompt_lookup"} <= set(kinds)
    assert kinds["eagle"].reads_features and kinds["eagle"].needs == "head"
    assert kinds["model"].needs == "model" and not kinds["prompt_lookup"].needs
    assert kinds["eagle"].pre_draft_guesses > kinds["model"].pre_draft_guesses


def test_a_kind_from_a_module_drafts_in_the_engine():
    """A module registers a kind (tests/serving/repeat_drafter.py); an engine without a draft model or head offers it
    and prompt lookup, and its sessions propose through the engine's batched path."""
    drafters.load_modules(["tests.serving.repeat_drafter"])
    engine = DraftEngine(None, vocab_size=100)
    assert set(engine.drafters) >= {"repeat", "prompt_lookup"} and "model" not in engine.drafters
    engine.start("s", [5, 6, 7], SamplingParams(), "repeat")
    assert engine.propose("s", 3).token_ids == [7, 7, 7]
    assert engine.propose("s", 2, accepts=[(1, 9, None)]).token_ids == [9, 9]  # kept one 7, then 9
    with pytest.raises(InvalidRequestError, match="unknown drafter 'eagle'"):
        engine.start("t", [1], SamplingParams(), "eagle")  # no head here


def test_names_are_unique_and_unknown_ones_are_refused():
    with pytest.raises(ValueError, match="registered already"):
        drafters.register(drafters.DrafterKind("model", start=lambda *a: None))
    with pytest.raises(InvalidRequestError, match="unknown drafter 'oracle'"):
        drafters.get("oracle")
    assert not drafters.reads_features("")


@pytest.mark.slow
def test_a_draft_stage_reads_only_what_the_eagle_head_needs_of_the_target(default_pair):
    """A draft stage of its own loads the EAGLE head on the target's embeddings and last layer read alone
    (loading.load_head_parts), not the whole target: the head is the one loaded on the whole target."""
    import torch

    from services import eagle_draft
    from services.loading import load_head_parts
    from services.models import default_pair as dp

    target, _ = default_pair
    path = eagle_draft.find(dp.drafter_dir())
    alone, whole = eagle_draft.load(path, load_head_parts(dp.target_dir())), eagle_draft.load(path, target)
    expected = whole.state_dict()
    assert set(alone.state_dict()) == set(expected)
    assert all(torch.equal(v, expected[k]) for k, v in alone.state_dict().items())
    assert torch.equal(alone.embed, whole.embed)
