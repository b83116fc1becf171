"""Conditional disaggregation: a prompt whose prefix-cache hit leaves a few positions has them computed by the verify
session's first step, in a batched pass with other sessions' rows, instead of a prefill pass over every weight.

The answer is the one a prefill of the whole prompt gives: the same greedy tokens, the same seeded samples (the
first token comes from the same random stream), and the other sessions in the pass get their verdicts unchanged."""

import pytest

from services.errors import InvalidRequestError
from services.loop import generate
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.verify import VerifyCall, VerifyEngine

SYSTEM = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
PROMPTS = [SYSTEM + [7, 8, 9, 10, 11], SYSTEM + [20, 21, 22], SYSTEM + [30, 31]]


def test_a_repeated_prompt_hands_its_last_position_to_the_verifier(tiny):
    target, _ = tiny
    engine = PrefillEngine(target, prefix_cache_bytes=2**20)
    first = engine.prefill(PROMPTS[0], SamplingParams(), local_tokens=4)
    assert first.first_token is not None and not first.prompt_rest  # nothing cached yet: a full prefill
    again = engine.prefill(PROMPTS[0], SamplingParams(), local_tokens=4)
    assert again.first_token is None and again.prompt_rest == PROMPTS[0][-1:]
    assert again.payload.seq_len == len(PROMPTS[0]) - 1 and engine.local_prefills == 1
    # a rest longer than local_tokens, or a request for features, is prefilled here
    other = engine.prefill(SYSTEM + [60, 61, 62, 63, 64, 65], SamplingParams(), local_tokens=4)
    assert other.first_token is not None and not other.prompt_rest
    assert engine.prefill(PROMPTS[0], SamplingParams(), features=True, local_tokens=4).first_token is not None
    assert engine.local_prefills == 1


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 2])
def test_the_answer_is_the_one_a_full_prefill_gives(tiny, params, k):
    target, draft = tiny
    from services.draft import DraftEngine

    verify, drafts = VerifyEngine(target), DraftEngine(draft) if k else None
    for prompt in PROMPTS:
        plain = PrefillEngine(target, prefix_cache_bytes=2**20)
        want = generate(plain, drafts, verify, prompt, max_new_tokens=20, num_draft_tokens=max(k, 1), params=params)
        cached = PrefillEngine(target, prefix_cache_bytes=2**20)
        cached.prefill(prompt[:-1] + [95], SamplingParams())  # caches all but the last position of the prompt
        got = generate(cached, drafts, verify, prompt, max_new_tokens=20, num_draft_tokens=max(k, 1), params=params,
                       local_tokens=4)
        assert cached.local_prefills == 1
        assert got.token_ids == want.token_ids


def test_a_first_step_shares_its_pass_with_other_sessions(tiny):
    """Greedy and sampled sessions, one of them still prefilling (with a rest of three positions), in one pass: each
    gets the verdict it gets alone, and the prefilling one the first token a full prefill draws."""
    target, _ = tiny
    prefill, cached = PrefillEngine(target), PrefillEngine(target, prefix_cache_bytes=2**20)
    sampled = SamplingParams(temperature=1.0, seed=5)
    cached.prefill(PROMPTS[0][:-3] + [90, 91, 92], SamplingParams())
    handed = cached.prefill(PROMPTS[0], sampled, local_tokens=4)
    assert handed.prompt_rest == PROMPTS[0][-3:]
    full = prefill.prefill(PROMPTS[0], sampled)

    def opened(engine):
        for i, (prompt, params) in enumerate(zip(PROMPTS[1:], (SamplingParams(), sampled))):
            result = prefill.prefill(prompt, params)
            engine.open(f"s{i}", result.payload, result.first_token, params)
        engine.open("rest", handed.payload, None, sampled, prompt_rest=handed.prompt_rest)
        return engine

    batched, alone = opened(VerifyEngine(target)), opened(VerifyEngine(target))
    calls = [VerifyCall("s0", [5, 6]), VerifyCall("rest", [], prompt_rows=2), VerifyCall("s1", [7])]
    assert calls[1].rows == 3
    results = batched.verify_batch(calls)
    assert results[1].token_ids == [full.first_token] and results[1].n_matches == 0
    for call, result in zip(calls, results):
        assert result == alone.verify(call.request_id, call.draft_token_ids)
    # then the session goes on as one opened from the full prefill
    plain = VerifyEngine(target)
    plain.open("full", full.payload, full.first_token, sampled)
    assert batched.verify("rest", [3, 4]) == plain.verify("full", [3, 4])


def test_a_first_step_takes_no_drafts_and_the_opening_is_one_or_the_other(tiny):
    target, _ = tiny
    cached = PrefillEngine(target, prefix_cache_bytes=2**20)
    cached.prefill(PROMPTS[0], SamplingParams())
    handed = cached.prefill(PROMPTS[0], SamplingParams(), local_tokens=4)
    engine = VerifyEngine(target)
    engine.open("rest", handed.payload, None, SamplingParams(), prompt_rest=handed.prompt_rest)
    (refused, other) = engine.verify_batch([VerifyCall("rest", [5]), VerifyCall("nobody", [])])
    assert isinstance(refused, InvalidRequestError) and "no drafts" in str(refused)
    assert engine.verify("rest", []).n_matches == 0  # the session is still usable: its first step, then drafts
    assert engine.verify("rest", [5]).token_ids
    with pytest.raises(InvalidRequestError, match="one of them"):
        engine.open("both", handed.payload, 3, SamplingParams(), prompt_rest=handed.prompt_rest)
    with pytest.raises(InvalidRequestError, match="one of them"):
        engine.open("neither", handed.payload, None, SamplingParams())
    with pytest.raises(InvalidRequestError, match="features"):
        engine.open("features", handed.payload, None, SamplingParams(), features=True, prompt_rest=handed.prompt_rest)


def test_transformers_forward_takes_a_first_step_too(tiny):
    """The generic runner (transformers' forward: every model on a GPU) computes a prefilling session's rows with
    the others' in one verify_batch and gives the same verdicts as the compact forward."""
    target, _ = tiny
    cached = PrefillEngine(target, prefix_cache_bytes=2**20)
    cached.prefill(PROMPTS[0][:-2] + [90, 91], SamplingParams())
    handed = cached.prefill(PROMPTS[0], SamplingParams(), local_tokens=2)
    full = PrefillEngine(target).prefill(PROMPTS[1], SamplingParams())
    verdicts = []
    for fast in (True, False):
        engine = VerifyEngine(target, fast=fast)
        engine.open("rest", handed.payload, None, SamplingParams(), prompt_rest=handed.prompt_rest)
        engine.open("other", full.payload, full.first_token, SamplingParams())
        verdicts.append(engine.verify_batch([VerifyCall("rest", [], prompt_rows=1), VerifyCall("other", [4, 5])]))
        verdicts.append([engine.verify("rest", [6, 7]), engine.verify("other", [])])
    assert verdicts[0] == verdicts[2] and verdicts[1] == verdicts[3]
