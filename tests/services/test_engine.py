"""Engine exactness on the tiny pair: greedy losslessness, KV payloads, rollback, bad input."""

import pytest
import torch

from services.draft import DraftEngine
from services.errors import InvalidRequestError, ModelMismatchError, SessionNotFoundError
from services.hf_runner import ModelRunner
from services.loading import check_pair
from services.loop import FINISH_LENGTH, generate, speculative_decode
from services.models.tiny import tiny_pair
from services.runner import make_runner
from services.sampling import SamplingParams
from services.verify import VerifyEngine
from tests.conftest import greedy_reference

PROMPTS = [[1, 5, 7, 9, 11], [1, 20], [1, 30, 31, 32, 30, 31], [2], [1, 40, 41, 42, 43, 44, 45, 46], [1, 9, 9, 9], [1, 60, 61], [1, 70, 12, 70, 12]]
NEW_TOKENS = 64


@pytest.mark.parametrize("drafter,k", [("model", 1), ("model", 3), ("model", 5), ("prompt_lookup", 2), ("prompt_lookup", 4)])
def test_greedy_equals_target_alone(tiny, tiny_engines, drafter, k):
    """Greedy speculative output is token-identical to generate(do_sample=False) of the target."""
    target, _ = tiny
    prefill, draft, verify = tiny_engines
    for prompt in PROMPTS:
        expected = greedy_reference(target.model, prompt, NEW_TOKENS)
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                          params=SamplingParams(), drafter=drafter)
        assert result.token_ids == expected, f"prompt {prompt}"


def test_speculation_off_equals_target_alone(tiny, tiny_engines):
    target, _ = tiny
    prefill, _, verify = tiny_engines
    for prompt in PROMPTS[:3]:
        result = generate(prefill, None, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=1, params=SamplingParams())
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS)
        assert result.stats.drafted == 0


def test_seed_reproduces_sampled_output(tiny_engines):
    prefill, draft, verify = tiny_engines
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    runs = [generate(prefill, draft, verify, PROMPTS[0], max_new_tokens=32, num_draft_tokens=3, params=params).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    other = generate(prefill, draft, verify, PROMPTS[0], max_new_tokens=32, num_draft_tokens=3, params=SamplingParams(temperature=0.9, top_p=0.95, seed=99))
    assert other.token_ids != runs[0]


def test_finish_reasons_and_budget(tiny_engines):
    prefill, draft, verify = tiny_engines
    target = prefill.target
    for budget in (5, 64):
        result = generate(prefill, draft, verify, PROMPTS[0], max_new_tokens=budget, num_draft_tokens=4, params=SamplingParams())
        reference = greedy_reference(target.model, PROMPTS[0], budget)
        eos = next((i for i, t in enumerate(reference) if t in target.eos_token_ids), None)
        if eos is None:  # the budget ran out first
            assert (result.finish_reason, result.token_ids) == (FINISH_LENGTH, reference)
        else:  # the answer ends at its first EOS, which it includes
            assert (result.finish_reason, result.token_ids) == ("stop", reference[: eos + 1])


def test_kv_payload_round_trip(tiny):
    """Logits after export -> import equal those of the uninterrupted model, bit for bit."""
    target, _ = tiny
    runner = make_runner(target)
    ids = torch.tensor([1, 5, 7, 9, 11, 13, 15])
    uninterrupted = runner.new_cache()
    runner.forward(ids[:5], uninterrupted)
    cache = runner.new_cache()
    runner.forward(ids[:5], cache)
    payload = cache.export(target.fingerprint)
    assert payload.seq_len == 5 and payload.keys[0].shape[1] == 5
    for array in payload.keys + payload.values:
        array.flags.writeable = False  # as the Ray object store hands them over
    imported = runner.import_payload(payload)
    assert torch.equal(runner.forward(ids[5:], imported), runner.forward(ids[5:], uninterrupted))


def test_payload_from_another_model_is_refused(tiny):
    target, _ = tiny
    other, _ = tiny_pair(seed=1)
    runner = ModelRunner(other)
    cache = runner.new_cache()
    runner.forward(torch.tensor([1, 2, 3]), cache)
    with pytest.raises(ModelMismatchError, match="same target model"):
        VerifyEngine(target).open("r", cache.export(other.fingerprint), 4, SamplingParams())


def _fresh_kv(model, tokens):
    runner = make_runner(model)
    cache = runner.new_cache()
    if tokens:
        runner.forward(torch.tensor(tokens), cache)
    return cache


def _assert_same_kv(a, b):
    assert a.seq_len == b.seq_len
    pa, pb = a.export("x"), b.export("x")
    for x, y in zip(pa.keys + pa.values, pb.keys + pb.values):
        torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(y), rtol=1e-5, atol=1e-5)


@pytest.fixture
def one_matmul_variant():
    """Pin every matmul to one BLAS call, so chunk sizes cannot change the rounding."""
    from services.fast_llama import Linear

    Linear.forced_variant = "row_major"
    yield
    Linear.forced_variant = None


def test_rollback_equals_fresh_forward(tiny, tiny_engines, one_matmul_variant):
    """After rejections, draft and verify caches equal a fresh forward over the accepted text.

    The drafter learns a verdict with its next proposal, so after a step its session holds the text up to that step.
    """
    target, draft_model = tiny
    prefill, draft, verify = tiny_engines
    prompt = PROMPTS[0]
    emitted, rejections, rejected_before = [], 0, False
    steps = speculative_decode(prefill, draft, verify, prompt, max_new_tokens=60, num_draft_tokens=4,
                               params=SamplingParams(), request_id="rollback")
    for i, step in enumerate(steps):
        before = list(emitted)
        emitted += step.token_ids
        rejected = step.n_matches < step.n_drafted
        rejections += rejected
        if i >= 2 and rejections >= 2 and rejected_before:  # the drafter has rolled back a rejection already
            vs = verify.sessions.get("rollback")
            assert vs.pending == emitted[-1]
            _assert_same_kv(vs.cache, _fresh_kv(target, prompt + emitted[:-1]))
            ds = draft.sessions.get("rollback")
            assert ds.tokens == prompt + before
            # rolled back to the accepted text, then extended over the proposal it made since
            _assert_same_kv(ds.cache, _fresh_kv(draft_model, (ds.tokens + ds.proposal)[: ds.cache.seq_len]))
            steps.close()
            break
        rejected_before = rejected
    assert rejections >= 2, "the tiny drafter should have been rejected at least twice"
    assert "rollback" not in verify.sessions and "rollback" not in draft.sessions  # closed on exit


@pytest.mark.parametrize(
    "prompt,kwargs,fragment",
    [
        ([], {}, "prompt is empty"),
        (list(range(1, 40)) * 20, {}, "context"),
        ([1, 2], {"num_draft_tokens": 0}, "num_draft_tokens"),
        ([1, 2], {"num_draft_tokens": 17}, "num_draft_tokens"),
        ([1, 2], {"params": SamplingParams(temperature=-1)}, "temperature"),
        ([1, 2], {"params": SamplingParams(temperature=1, top_p=0)}, "top_p"),
        ([1, 2], {"params": SamplingParams(temperature=1, top_p=1.01)}, "top_p"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 500], {}, "outside the vocabulary"),
        ([1, 2], {"drafter": "eagle"}, "unknown drafter"),
    ],
)
def test_bad_input_raises_typed_error(tiny_engines, prompt, kwargs, fragment):
    prefill, draft, verify = tiny_engines
    args = {"max_new_tokens": 8, "num_draft_tokens": 3, "params": SamplingParams()} | kwargs
    with pytest.raises(InvalidRequestError, match=fragment):
        generate(prefill, draft, verify, prompt, **args)
    # and the engines keep serving
    assert generate(prefill, draft, verify, [1, 2], max_new_tokens=4, num_draft_tokens=2, params=SamplingParams()).token_ids


def test_sessions_are_bounded_and_evictions_are_typed(tiny):
    _, draft_model = tiny
    draft = DraftEngine(draft_model, max_sessions=2)
    for rid in ("a", "b", "c"):
        draft.start(rid, [1, 2, 3], SamplingParams())
    assert len(draft.sessions) == 2
    with pytest.raises(SessionNotFoundError, match="evicted"):
        draft.propose("a", 2)
    with pytest.raises(SessionNotFoundError, match="unknown or already closed"):
        draft.propose("zzz", 2)
    assert len(draft.propose("c", 2).token_ids) == 2


def test_sessions_are_bounded_by_kv_bytes(tiny):
    target, draft_model = tiny
    one_session = _fresh_kv(draft_model, [1, 2]).nbytes
    draft = DraftEngine(draft_model, max_kv_bytes=one_session * 3)
    for rid in ("a", "b", "c", "d"):
        draft.start(rid, [1, 2, 3], SamplingParams())
    assert draft.sessions.kv_bytes <= one_session * 3
    assert "a" not in draft.sessions and "d" in draft.sessions


def test_idle_sessions_are_reaped(tiny):
    """Sessions nobody called for longer than the bound are closed, least recently used first; a call keeps one."""
    _, draft_model = tiny
    now = [0.0]
    draft = DraftEngine(draft_model)
    draft.sessions.clock = lambda: now[0]
    draft.start("old", [1, 2, 3], SamplingParams())
    now[0] = 5.0
    draft.start("used", [1, 2, 3], SamplingParams())
    draft.start("new", [1, 2, 3], SamplingParams())
    now[0] = 8.0
    draft.propose("used", 1)
    now[0] = 12.0
    assert draft.sessions.reap(10.0) == ["old"]
    assert draft.sessions.reap(10.0) == []
    now[0] = 16.0
    assert draft.sessions.reap(10.0) == ["new"] and "used" in draft.sessions
    with pytest.raises(SessionNotFoundError, match="closed after 10s without a call"):
        draft.propose("old", 1)
    assert draft.sessions.reaped == 2


def test_pair_with_other_vocab_is_refused(tiny):
    target, _ = tiny
    from transformers import LlamaForCausalLM

    from services.loading import wrap_model
    from services.models.tiny import tiny_config

    config = tiny_config(1)
    config.vocab_size = 50
    other = wrap_model(LlamaForCausalLM(config), model_id="odd-drafter")
    with pytest.raises(ModelMismatchError, match="odd-drafter.*tiny-target-0"):
        check_pair(target, other)
