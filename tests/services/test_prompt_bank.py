"""The drafter's prompt mix: broad, seeded, and held-out subjects never leak into training."""

import pytest

from services.training import prompt_bank


def test_held_out_subjects_never_in_training():
    """No training prompt names a held-out subject, so held-out acceptance is not memorisation."""
    train = [p for _, p in prompt_bank.crossed_prompts(seed=0)]
    prompt_bank.check_disjoint(train)
    assert not any(prompt_bank.mentions_held_out(p) for p in train)


def test_check_disjoint_catches_a_leak():
    """A training prompt naming a held-out subject is refused."""
    subject = prompt_bank.held_out_subjects()[0]
    with pytest.raises(ValueError, match="held-out"):
        prompt_bank.check_disjoint([f"Tell me about {subject}."])


def test_every_kind_is_covered_and_seeded():
    """All kinds appear in training and held-out; the same seed gives the same order."""
    train = prompt_bank.crossed_prompts(seed=0)
    kinds = {k.name for k in prompt_bank.KINDS}
    assert {k for k, _ in train} == kinds
    assert {k for k, _ in prompt_bank.held_out_prompts()} == kinds
    assert train == prompt_bank.crossed_prompts(seed=0)
    assert train != prompt_bank.crossed_prompts(seed=1)
    assert len(train) > 1000
    assert all("{" not in p for _, p in train)
