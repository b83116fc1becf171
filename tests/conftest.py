"""Shared fixtures: the tiny random pair (fast) and the default SmolLM2 pair (slow, prepared once)."""

import pytest
import torch

from services.draft import DraftEngine
from services.models.tiny import tiny_pair
from services.prefill import PrefillEngine
from services.verify import VerifyEngine


# One intra-op thread: the models here are small, and oversubscribed OpenMP
# threads (a Ray worker or a benchmark beside the tests) slow everything down.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny():
    """(target, draft) LoadedModels of the tiny pair."""
    return tiny_pair(seed=0)


@pytest.fixture(scope="session")
def tiny_engines(tiny):
    target, draft = tiny
    return PrefillEngine(target), DraftEngine(draft), VerifyEngine(target)


@pytest.fixture(scope="session")
def default_pair():
    """(target, draft) of the default pair; prepares it on first use (cached afterwards)."""
    from services.loading import check_pair, load_causal_lm
    from services.models import default_pair as dp

    target_dir, drafter_dir = dp.prepare()
    target = load_causal_lm(target_dir)
    draft = load_causal_lm(drafter_dir)
    check_pair(target, draft)
    return target, draft


_REFERENCES: dict = {}


def greedy_reference(model, prompt_ids, max_new_tokens):
    """Target alone: transformers' generate with do_sample=False (memoised per model and prompt)."""
    key = (id(model), tuple(prompt_ids), max_new_tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = _generate(model, prompt_ids, max_new_tokens)
    return _REFERENCES[key]


def _generate(model, prompt_ids, max_new_tokens):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
        )
    return out[0, len(prompt_ids):].tolist()
