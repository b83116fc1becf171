"""Batched verification (VerifyEngine.verify_batch): each session's verdict is the one it gets alone."""

import pytest
import torch

from services.errors import InvalidRequestError, SessionNotFoundError
from services.prefill import PrefillEngine
from services.runner import make_runner
from services.sampling import SamplingParams
from services.verify import VerifyCall, VerifyEngine

PROMPTS = [[1, 5, 7, 9, 11], [1, 20], [1, 30, 31, 32, 30, 31], [2], [1, 40, 41, 42, 43, 44, 45, 46], [1, 9, 9, 9]]
# greedy and seeded sampled sessions in one batch, with their own parameters
PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(),
    SamplingParams(temperature=1.2, top_k=20, seed=2),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(),
]


def test_forward_batch_rows_equal_forward_alone(tiny):
    """Ragged chunks of several sequences in one pass: each chunk's logits and KV are those of its pass alone."""
    target, _ = tiny
    runner = make_runner(target)
    alone, batched = [], []
    for prompt in PROMPTS[:4]:
        for caches in (alone, batched):
            cache = runner.new_cache()
            runner.forward(torch.tensor(prompt), cache)
            caches.append(cache)
    chunks = [torch.tensor(ids) for ids in ([3, 4, 5], [6], [7, 8], [9, 10, 11, 12, 13])]
    expected = [runner.forward(ids, cache, return_features=True) for ids, cache in zip(chunks, alone)]
    logits, features = runner.forward_batch(list(zip(chunks, batched)))
    for (want_logits, want_features), got_logits, got_features, a, b in zip(expected, logits, features, alone, batched):
        assert torch.equal(got_logits, want_logits)
        assert torch.equal(got_features, want_features)
        assert a.seq_len == b.seq_len
        assert torch.equal(a.buffer[:, :, :, : a.seq_len], b.buffer[:, :, :, : b.seq_len])


def _open_sessions(target, engine: VerifyEngine, prefix: str) -> None:
    """One session per prompt, with its own sampling parameters."""
    prefill = PrefillEngine(target)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        result = prefill.prefill(prompt, params)
        engine.open(f"{prefix}{i}", result.payload, result.first_token, params)


def _draft_for(engine: VerifyEngine, request_id: str, k: int, step: int) -> list[int]:
    """k draft ids: the first one right (the target's argmax) on even steps, then arbitrary ones."""
    session = engine.sessions.get(request_id)
    ids = [(session.pending * 7 + step * 13 + j) % (engine.target.vocab_size - 3) + 3 for j in range(k)]
    if k and step % 2 == 0:
        cache = session.cache
        logits = engine.runner.forward(torch.tensor([session.pending]), cache)
        cache.crop(cache.seq_len - 1)
        ids[0] = int(logits[-1].argmax())
    return ids


def test_batched_verify_equals_verify_alone(tiny):
    """Mixed k, greedy and sampled sessions in one pass: the same tokens, verdicts and KV as verifying each alone."""
    target, _ = tiny
    alone, batched = VerifyEngine(target), VerifyEngine(target)
    _open_sessions(target, alone, "s")
    _open_sessions(target, batched, "s")
    accepted = 0
    for step in range(8):
        calls = []
        for i in range(len(PROMPTS)):
            k = (i + step) % 5  # 0 .. 4 drafts, different per session and step
            calls.append(VerifyCall(f"s{i}", _draft_for(alone, f"s{i}", k, step)))
        expected = [alone.verify(call.request_id, call.draft_token_ids) for call in calls]
        got = batched.verify_batch(calls)
        assert got == expected, f"step {step}"
        accepted += sum(result.n_matches for result in got)
        for call in calls:
            a, b = alone.sessions.get(call.request_id), batched.sessions.get(call.request_id)
            assert (a.pending, a.cache.seq_len) == (b.pending, b.cache.seq_len)
            assert torch.equal(a.cache.buffer[:, :, :, : a.cache.seq_len], b.cache.buffer[:, :, :, : b.cache.seq_len])
    assert accepted > 0, "some drafts should have been accepted (per-session rollback of the rest)"


@pytest.mark.parametrize(
    "bad,error,fragment",
    [
        (VerifyCall("nobody", [3]), SessionNotFoundError, "unknown"),
        (VerifyCall("s1", [3, 100_000]), InvalidRequestError, "draft token ids"),
        (VerifyCall("s1", list(range(3, 20))), InvalidRequestError, "at most"),
        (VerifyCall("s1", [3, 4], params=SamplingParams(temperature=-1)), InvalidRequestError, "temperature"),
        (VerifyCall("s1", [3, 4], draft_probs=torch.ones(1, 7)), InvalidRequestError, "draft_probs"),
        (VerifyCall("s0", [3]), InvalidRequestError, "two verify calls"),
    ],
)
def test_bad_call_fails_only_its_own_slot(tiny, bad, error, fragment):
    target, _ = tiny
    alone, batched = VerifyEngine(target), VerifyEngine(target)
    _open_sessions(target, alone, "s")
    _open_sessions(target, batched, "s")
    good = [VerifyCall("s0", [5, 6]), VerifyCall("s2", []), VerifyCall("s3", [9])]
    results = batched.verify_batch([good[0], bad, *good[1:]])
    assert isinstance(results[1], error) and fragment in str(results[1])
    assert [results[0], *results[2:]] == [alone.verify(c.request_id, c.draft_token_ids) for c in good]
    # the bad call's session (when it exists) was not advanced
    if bad.request_id == "s1":
        assert batched.sessions.get("s1").cache.seq_len == alone.sessions.get("s1").cache.seq_len


def test_batched_prefill_equals_prefill_alone(tiny):
    """Prompts of different lengths and sampling parameters in one pass: each its first token, KV and features as
    alone; an empty prompt fails only its own slot."""
    from services.prefill import PrefillCall

    target, _ = tiny
    engine = PrefillEngine(target)
    calls = [PrefillCall(prompt, params, features=i % 2 == 0) for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS))]
    calls.insert(2, PrefillCall([], SamplingParams()))
    results = engine.prefill_batch(calls)
    assert isinstance(results[2], InvalidRequestError) and "empty" in str(results[2])
    for call, got in zip(calls[:2] + calls[3:], results[:2] + results[3:]):
        want = engine.prefill(call.prompt_ids, call.params, features=call.features)
        assert got.first_token == want.first_token
        assert got.payload.seq_len == want.payload.seq_len == len(call.prompt_ids)
        for a, b in zip(got.payload.keys + got.payload.values, want.payload.keys + want.payload.values):
            assert (a == b).all()
        assert (got.features is None) == (want.features is None) == (not call.features)
        if call.features:
            assert torch.equal(got.features, want.features)


def test_a_long_prompt_prefilled_in_chunks_equals_it_in_one_pass(tiny):
    """Chunk by chunk, in passes shared with a short prompt: the same first token, KV (to rounding) and features."""
    from services.prefill import PrefillCall, PrefillProgress

    target, _ = tiny
    engine = PrefillEngine(target)
    prompt = [1] + [(7 * i) % 90 + 3 for i in range(70)]
    params = SamplingParams(temperature=0.9, seed=5)
    whole = engine.prefill(prompt, params, features=True)
    call = PrefillCall(prompt, params, features=True, request_id="long", chunk=16)
    passes = 0
    while True:
        short = PrefillCall(PROMPTS[passes % len(PROMPTS)], SamplingParams(), request_id=f"short{passes}")
        result, other = engine.prefill_batch([call, short])
        passes += 1
        assert other.first_token == engine.prefill(short.prompt_ids, short.params).first_token
        if not isinstance(result, PrefillProgress):
            break
        call = PrefillCall(prompt, params, features=True, request_id="long", start=result.done, chunk=16)
    assert passes == 5  # 71 positions in chunks of 16
    assert result.first_token == whole.first_token
    for a, b in zip(result.payload.keys + result.payload.values, whole.payload.keys + whole.payload.values):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(result.features.float(), whole.features.float(), rtol=2e-2, atol=2e-2)
    assert not engine._partial  # nothing kept once the prompt is done
    # a continuation without its earlier chunks is a typed error, not a crash
    (missing,) = engine.prefill_batch([PrefillCall(prompt, params, request_id="nobody", start=16, chunk=16)])
    assert isinstance(missing, SessionNotFoundError)
