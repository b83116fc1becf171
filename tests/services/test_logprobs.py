"""Logprobs (services.logprobs) under speculation: the target's values of the emitted tokens, equal to speculation
off to 1e-5 (greedy and seeded sampled; model, EAGLE and tree drafts), on every path a token is drawn on (prefill,
chunked prefill, a prefix-cache hit's local prefill, verify passes, a reopened session), and asking for them
changes no token."""

import math

import pytest
import torch

from services.draft import DraftEngine
from services.errors import InvalidRequestError
from services.logprobs import LOGPROB_FLOOR, target_logprobs
from services.loop import generate
from services.prefill import PrefillCall, PrefillEngine, PrefillProgress
from services.runner import make_runner
from services.sampling import SamplingParams
from services.verify import VerifyCall, VerifyEngine
from tests.services.test_eagle_drafter import random_head
from tests.services.test_engine import PROMPTS
from tests.services.test_recovery import run_with_losses

NEW_TOKENS = 24
TOP = 5  # alternatives asked for
TOL = 1e-5
GREEDY = SamplingParams(logprobs=TOP)
SAMPLED = [SamplingParams(temperature=0.8, seed=7, logprobs=TOP),
           SamplingParams(temperature=1.0, top_k=8, seed=3, logprobs=TOP),
           SamplingParams(temperature=0.9, top_p=0.9, seed=11, logprobs=TOP),
           SamplingParams(temperature=1.2, top_k=20, top_p=0.8, seed=5, logprobs=TOP)]
# (drafter kind, k, tree width): chains of the model drafter and EAGLE, and trees of both (greedy requests only)
DRAFTS = [("model", 3, 1), ("eagle", 3, 1), ("model", 2, 3), ("eagle", 3, 3)]


@pytest.fixture(scope="module")
def engines(tiny):
    target, draft = tiny
    return PrefillEngine(target), DraftEngine(draft, eagle_head=random_head(target)), VerifyEngine(target)


def spec_off_logprobs(target, prompt, tokens, params) -> torch.Tensor:  # -> [len(tokens), vocab_size]
    """The target alone, teacher-forced along ``tokens``: what speculation off computes for each position (the
    prompt's last row, then one row per pass), as a reference independent of the engines under test."""
    runner = make_runner(target, batch_invariant=True)
    cache = runner.new_cache()
    rows = [runner.forward(torch.tensor(prompt), cache, last_only=True)]  # [1, V]
    for token in tokens[:-1]:
        rows.append(runner.forward(torch.tensor([token]), cache))
    return target_logprobs(torch.cat(rows), params)


def assert_same(got, want, tol=TOL):
    """Two runs' logprobs: the same tokens, values within ``tol``, the same alternatives (ids, then values)."""
    assert [e.token_id for e in got] == [e.token_id for e in want]
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a.logprob - b.logprob) <= tol, (i, a, b)
        assert [t for t, _ in a.top] == [t for t, _ in b.top], (i, a.top, b.top)
        assert all(abs(x - y) <= tol for (_, x), (_, y) in zip(a.top, b.top)), (i, a.top, b.top)


def assert_match_reference(target, prompt, result, params):
    reference = spec_off_logprobs(target, prompt, result.token_ids, params)  # [n, V]
    assert len(result.logprobs) == len(result.token_ids)
    for i, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        assert entry.token_id == token
        assert abs(entry.logprob - float(reference[i, token])) <= TOL, (i, entry.logprob, float(reference[i, token]))
        values, _ = reference[i].sort(descending=True)
        assert [round(v, 4) for _, v in entry.top] == [round(float(v), 4) for v in values[:TOP]], i
        assert all(abs(float(reference[i, t]) - v) <= TOL for t, v in entry.top)


def run(engines, prompt, params, drafter="", k=1, width=1, **kwargs):
    prefill, drafts, verify = engines
    return generate(prefill, drafts if drafter else None, verify, prompt, max_new_tokens=NEW_TOKENS,
                    num_draft_tokens=k, params=params, drafter=drafter or "model", tree_width=width, **kwargs)


@pytest.mark.parametrize("drafter,k,width", DRAFTS, ids=[f"{d}-k{k}-w{w}" for d, k, w in DRAFTS])
def test_greedy_logprobs_with_speculation_equal_speculation_off(tiny, engines, drafter, k, width):
    target, _ = tiny
    accepted = 0
    for prompt in PROMPTS:
        off = run(engines, prompt, GREEDY)
        on = run(engines, prompt, GREEDY, drafter, k, width)
        plain = run(engines, prompt, SamplingParams(), drafter, k, width)  # no logprobs: the argmax-only pass
        assert on.token_ids == off.token_ids == plain.token_ids and plain.logprobs is None, prompt
        assert_same(on.logprobs, off.logprobs)
        assert_match_reference(target, prompt, on, GREEDY)
        assert all(e.top[0][0] == e.token_id for e in on.logprobs)  # greedy: the emitted token is the likeliest
        accepted += on.stats.accepted
    assert accepted > 0, "no draft was accepted: accepted tokens' rows were not exercised"


@pytest.mark.parametrize("drafter,k", [("model", 3), ("eagle", 2)])
@pytest.mark.parametrize("params", SAMPLED, ids=["t", "top_k", "top_p", "top_k+top_p"])
def test_sampled_logprobs_with_speculation_equal_speculation_off(tiny, engines, params, drafter, k):
    """Seeded sampling: the two runs draw different tokens, so each is checked against the target alone along its
    own tokens (teacher-forced, one row per pass: speculation off); asking for logprobs changes no token."""
    target, _ = tiny
    accepted = 0
    for prompt in PROMPTS[:4]:
        on = run(engines, prompt, params, drafter, k)
        off = run(engines, prompt, params)
        assert on.token_ids == run(engines, prompt, SamplingParams(params.temperature, params.top_k, params.top_p,
                                                                    params.seed), drafter, k).token_ids
        for result in (on, off):
            assert_match_reference(target, prompt, result, params)
            assert all(e.logprob > LOGPROB_FLOOR for e in result.logprobs)  # a drawn token has p > 0
        accepted += on.stats.accepted
    assert accepted > 0


def test_top_logprobs_are_of_the_processed_distribution(engines):
    """top-k 3 with 5 asked for: three alternatives carry all the mass, the other two are at the floor."""
    params = SamplingParams(temperature=1.0, top_k=3, seed=1, logprobs=TOP)
    result = run(engines, PROMPTS[0], params, "model", 3)
    for entry in result.logprobs:
        assert math.isclose(sum(math.exp(v) for _, v in entry.top[:3]), 1.0, rel_tol=1e-5)
        assert [v for _, v in entry.top[3:]] == [LOGPROB_FLOOR] * 2
        assert entry.token_id in [t for t, _ in entry.top[:3]]
    assert run(engines, PROMPTS[0], SamplingParams(logprobs=0)).logprobs[0].top == ()


@pytest.mark.parametrize("params", [GREEDY, SAMPLED[0]], ids=["greedy", "seeded"])
def test_first_token_of_a_chunked_prefill_and_of_a_local_prefill(tiny, params):
    """The first token's logprob is the same whether its row comes from one prefill pass, the last of several
    chunks, or the verify session's first step (a prefix-cache hit that left the prompt's last positions to it)."""
    target, _ = tiny
    prompt = PROMPTS[4]
    whole = PrefillEngine(target).prefill(prompt, params)
    chunked, call = PrefillEngine(target), PrefillCall(prompt, params, request_id="c", chunk=3)
    while isinstance(result := chunked.prefill_batch([call])[0], PrefillProgress):
        call = PrefillCall(prompt, params, request_id="c", chunk=3, start=result.done)
    assert result.first_token == whole.first_token
    assert_same([result.first_logprob], [whole.first_logprob])
    cached = PrefillEngine(target, prefix_cache_bytes=2**20)
    cached.prefill(prompt[:-2] + [90, 91], SamplingParams())
    handed = cached.prefill(prompt, params, local_tokens=4)
    assert handed.first_token is None and handed.first_logprob is None
    verify = VerifyEngine(target)
    verify.open("rest", handed.payload, None, params, prompt_rest=handed.prompt_rest)
    verdict = verify.verify("rest", [])
    assert verdict.token_ids == [whole.first_token]
    assert_same(verdict.logprobs, [whole.first_logprob])
    # and through the loop: the same answer and logprobs as a full prefill's
    drafts = DraftEngine(tiny[1])
    want = generate(PrefillEngine(target), drafts, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=2,
                    params=params)
    got = generate(cached, drafts, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=2, params=params,
                   local_tokens=4)
    assert got.token_ids == want.token_ids
    assert_same(got.logprobs, want.logprobs)


def test_a_pass_mixes_sessions_with_and_without_logprobs(tiny, engines):
    """Greedy sessions with logprobs (logits rows) and without (argmax ids) in one verify pass: the same tokens."""
    target, _ = tiny
    prefill, _, _ = engines
    verify, alone = VerifyEngine(target), VerifyEngine(target)
    for engine in (verify, alone):
        for name, params in (("ids", SamplingParams()), ("logprobs", GREEDY), ("sampled", SAMPLED[1])):
            first = prefill.prefill(PROMPTS[0], params)
            engine.open(name, first.payload, first.first_token, params)
    calls = [VerifyCall("ids", [5, 6, 7]), VerifyCall("logprobs", [5, 6, 7]), VerifyCall("sampled", [5, 6])]
    batched = verify.verify_batch(calls)
    assert batched[0].token_ids == batched[1].token_ids and batched[0].logprobs is None
    assert len(batched[1].logprobs) == len(batched[1].token_ids) and len(batched[2].logprobs) == len(batched[2].token_ids)
    for call, result in zip(calls, batched):
        single = alone.verify(call.request_id, call.draft_token_ids)
        assert result.token_ids == single.token_ids
        if result.logprobs is not None:
            assert_same(result.logprobs, single.logprobs, tol=0.0)  # (batch-invariant: the same bits)


def run_losing_verify(engines, prompt, params, lose_at: tuple[int, ...]):
    """Decode with k = 2 (the model drafter), losing the verify session before the verify calls numbered in
    ``lose_at`` and reopening it as the ingress does; the tokens and their logprobs."""
    entries = []
    tokens, _ = run_with_losses(engines, prompt, "model", lose_verify_at=lose_at, params=params, entries=entries)
    return tokens, entries


@pytest.mark.parametrize("params", [GREEDY, SAMPLED[0]], ids=["greedy", "seeded"])
def test_a_reopened_verify_session_neither_loses_nor_repeats_entries(tiny, engines, params):
    """A verify session lost mid-request and reopened: one logprob per emitted token, each the target's along the
    tokens emitted (greedy: the same tokens and values as without the loss)."""
    target, draft = tiny
    prompt = PROMPTS[0]
    tokens, entries = run_losing_verify(engines, prompt, params, lose_at=(1, 3, 4))
    assert len(entries) == len(tokens) == NEW_TOKENS and [e.token_id for e in entries] == tokens
    reference = spec_off_logprobs(target, prompt, tokens, params)
    assert all(abs(e.logprob - float(reference[i, e.token_id])) <= TOL for i, e in enumerate(entries))
    if params.greedy:
        assert_same(entries, run(engines, prompt, params).logprobs)


def test_top_logprobs_out_of_range_are_refused():
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(InvalidRequestError, match="top_logprobs"):
            SamplingParams(logprobs=bad).validate()
    assert SamplingParams(logprobs=20).validate().logprobs == 20
