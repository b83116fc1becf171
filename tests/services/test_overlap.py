"""Pre-drafting (services.loop, ``overlap=True``) on the tiny pair: the drafter drafts beyond the block under
verification; greedy output stays identical to the target alone, sampled output follows the target exactly."""

import copy

import pytest
import torch

from services.draft import DraftEngine
from services.loading import wrap_model
from services.loop import SpeculativeLoop, drive, generate
from services.models.tiny import TINY_VOCAB_SIZE
from services.prefill import PrefillEngine
from services.sampling import SamplingParams, logits_to_probs
from services.verify import VerifyEngine
from tests.conftest import greedy_reference
from tests.services.test_engine import NEW_TOKENS, PROMPTS
from tests.services.test_sampling import assert_follows

DRAWS = 3000


@pytest.mark.parametrize("drafter,k,guesses", [("model", 1, 1), ("model", 3, 1), ("model", 2, 3), ("prompt_lookup", 2, 1)])
def test_greedy_equals_target_alone(tiny, tiny_engines, drafter, k, guesses):
    target, _ = tiny
    prefill, draft, verify = tiny_engines
    hits = 0
    for prompt in PROMPTS:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                          params=SamplingParams(), drafter=drafter, overlap=True, guesses=guesses)
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), f"prompt {prompt}"
        assert result.stats.pre_drafts >= result.stats.steps - 1  # every verification but the last overlapped one
        hits += result.stats.pre_draft_hits
    assert hits > 0, "no pre-drafted block was used: the hit path was not exercised"


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_forced_tokens_continue_the_proposal(tiny_engines, drafter):
    """Drafting after forced tokens = drafting them and going on (greedy; prompt lookup matches n-grams afresh);
    a verdict on them is an ordinary accept."""
    prefill, draft, _ = tiny_engines
    prompt = PROMPTS[2]
    draft.start("whole", prompt, SamplingParams(), drafter)
    draft.start("forced", prompt, SamplingParams(), drafter)
    whole = draft.propose("whole", 5).token_ids
    after = draft.propose("forced", 3, forced=whole[:2]).token_ids
    if drafter == "model":
        assert after == whole[2:]
    assert draft.sessions.get("forced").proposal == whole[:2] + after
    draft.accept("forced", 2, 7)  # both forced tokens accepted, then another token
    assert draft.sessions.get("forced").tokens == prompt + whole[:2] + [7]
    for sid in ("whole", "forced"):
        draft.close(sid)


@pytest.mark.parametrize("guesses", [1, 3])
def test_pre_draft_branches(tiny_engines, guesses):
    """One block per likely verdict: after all forced tokens (top guesses), and after the first one rejected (others);
    the main branch equals drafting on (greedy), and the session accepts a verdict on the forced tokens."""
    prefill, draft, _ = tiny_engines
    prompt = PROMPTS[2]
    draft.start("whole", prompt, SamplingParams(), "model")
    draft.start("branches", prompt, SamplingParams(), "model")
    whole = draft.propose("whole", 5).token_ids
    branches = draft.propose("branches", 2, forced=whole[:2], guesses=guesses).branches
    keys = [(b.n_matches, b.next_token) for b in branches]
    assert keys[0] == (2, whole[2]) and branches[0].token_ids == whole[3:5]
    assert len(keys) == len(set(keys)) == guesses + (guesses - 1)
    assert all(n == 0 and t != whole[0] for n, t in keys[guesses:])
    draft.accept("branches", 1, 9)
    assert draft.sessions.get("branches").tokens == prompt + whole[:1] + [9]
    # the KV after the branches is still right: drafting on equals drafting afresh
    draft.start("fresh", prompt + whole[:1] + [9], SamplingParams(), "model")
    assert draft.propose("branches", 4).token_ids == draft.propose("fresh", 4).token_ids
    for sid in ("whole", "branches", "fresh"):
        draft.close(sid)


def test_seed_reproduces_sampled_output(tiny_engines):
    prefill, draft, verify = tiny_engines
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    runs = [generate(prefill, draft, verify, PROMPTS[0], max_new_tokens=32, num_draft_tokens=3, params=params,
                     overlap=True, guesses=3).token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_sampled_tokens_follow_the_target(tiny):
    """Given the first two tokens, the third follows the target's p — overall, and on the pre-drafted (hit) path.

    The drafter is the target with noise added (q close to p, not equal), so one of its three guesses of the second
    token is often right and the block it drafted after that guess is verified with its own q.
    """
    target, _ = tiny
    noisy = copy.deepcopy(target.model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std())
    prefill, draft, verify = PrefillEngine(target), DraftEngine(wrap_model(noisy, model_id="noisy")), VerifyEngine(target)
    prompt, first = [1, 40, 41, 42, 43], 44
    params = SamplingParams(temperature=1.0)
    handoff = prefill.prefill(prompt, params)
    thirds: dict[int, list[tuple[int, bool]]] = {}  # second token -> (third token, came from a pre-drafted block)
    accepted = 0
    for seed in range(DRAWS):
        seeded = SamplingParams(temperature=1.0, seed=seed)
        verify.open("r", handoff.payload, first, seeded)
        draft.start("r", prompt, seeded, "model")
        loop = SpeculativeLoop(first, max_new_tokens=6, eos=set(), num_draft_tokens=2, drafting=True, overlap=True,
                               guesses=3)
        steps = drive(loop, draft, verify, "r")
        next(steps)  # the first token
        second = next(steps)  # decoded by the target while the drafter guessed it
        third = next(steps)
        steps.close()
        verify.close("r")
        draft.close("r")
        hit = third.n_drafted > 0
        accepted += third.n_matches
        thirds.setdefault(second.token_ids[0], []).append((third.token_ids[0], hit))
    second, draws = max(thirds.items(), key=lambda kv: len(kv[1]))
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt + [first, second]])).logits[0, -1:]
    p = logits_to_probs(logits.float(), params)[0]  # [vocab_size]
    on_hits = [t for t, hit in draws if hit]
    assert len(on_hits) >= 100 and accepted > 0, f"{len(on_hits)} hits, {accepted} accepted: the hit path is too rare"
    for tokens in ([t for t, _ in draws], on_hits):
        assert_follows(torch.bincount(torch.tensor(tokens), minlength=TINY_VOCAB_SIZE).float(), p)
