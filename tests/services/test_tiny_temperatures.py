"""Temperatures near 0 (issue 37): any temperature > 0 samples, and one session's failed step in a shared pass fails
that session alone.

At 1e-38 or 1e-45 (a subnormal), ``logits / temperature`` overflowed to inf, the softmax gave NaN and
``torch.multinomial`` raised inside ``verify_batch``, after the shared pass and outside any per-session isolation:
every session of the pass failed, with its KV advanced."""

import pytest
import torch

import services.verify
from services.prefill import PrefillEngine
from services.sampling import SamplingParams, logits_to_probs, make_generator, sample
from services.verify import VerifyCall, VerifyEngine

TINY = [1e-30, 1e-38, 1e-45, 5e-324]  # the last: float64's smallest subnormal
PROMPTS = [[1, 5, 7, 9, 11], [1, 20, 21, 22], [1, 30, 31, 32, 33, 34], [1, 40, 41], [1, 50, 51, 52]]


@pytest.mark.parametrize("temperature", TINY)
def test_a_tiny_temperature_is_one_hot_at_the_argmax(temperature):
    logits = torch.tensor([[3.0, 1.0, 2.5, -40.0], [7.0, 7.0, -1.0, 0.0]])  # row 1: an exact tie
    for top_k, top_p in [(0, 1.0), (2, 1.0), (0, 0.9)]:
        probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        assert torch.isfinite(probs).all()
        assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
        assert probs[1, 0] > 0 and probs[1, 2:].sum() == 0  # the tie shares the mass (top_p may keep one of it)
        assert sample(probs, make_generator(0, 1)).tolist()[0] == 0


def test_greedy_and_tiny_temperature_sessions_share_a_pass(tiny):
    """One verify pass over a greedy session and sessions at 1e-30, 1e-38 and 1e-45 (drafting the target's own
    tokens): every session gets its verdict, and the greedy one the verdict it gets alone."""
    target, _ = tiny
    prefill, verify, alone = PrefillEngine(target), VerifyEngine(target), VerifyEngine(target)
    params = [SamplingParams()] + [SamplingParams(temperature=t, seed=3) for t in TINY[:3]]
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        handoff = prefill.prefill(prompt, p)
        verify.open(f"s{i}", handoff.payload, handoff.first_token, p)
        if i == 0:
            alone.open("s0", handoff.payload, handoff.first_token, p)
    drafts = [[5, 6, 7]] * len(params)
    results = verify.verify_batch([VerifyCall(f"s{i}", d) for i, d in enumerate(drafts)])
    assert not any(isinstance(r, Exception) for r in results), results
    assert results[0] == alone.verify("s0", drafts[0])
    # near 0 a sampled session follows the argmax, as greedy does
    for i, p in enumerate(params[1:], start=1):
        greedy = VerifyEngine(target)
        handoff = prefill.prefill(PROMPTS[i], SamplingParams())
        greedy.open("g", handoff.payload, handoff.first_token, SamplingParams())
        assert results[i].token_ids == greedy.verify("g", drafts[i]).token_ids, p


def test_a_failed_step_fails_its_session_alone(tiny, monkeypatch):
    """A session whose step raises after the shared pass gets the error in its slot, its KV as before the call; the
    others in the pass get their verdicts."""
    target, _ = tiny
    prefill, verify, alone = PrefillEngine(target), VerifyEngine(target), VerifyEngine(target)
    doomed = SamplingParams(temperature=0.7, seed=1)
    for name, prompt, p in [("ok", PROMPTS[0], SamplingParams()), ("doomed", PROMPTS[1], doomed),
                            ("ok2", PROMPTS[2], SamplingParams(temperature=0.9, seed=2))]:
        handoff = prefill.prefill(prompt, p)
        verify.open(name, handoff.payload, handoff.first_token, p)
        if name != "doomed":
            alone.open(name, handoff.payload, handoff.first_token, p)
    before = verify.sessions.get("doomed").cache.seq_len
    real = services.verify.logits_to_probs

    def failing(logits, params):
        if params == doomed:
            raise RuntimeError("this session's step failed")
        return real(logits, params)

    monkeypatch.setattr(services.verify, "logits_to_probs", failing)
    ok, failed, ok2 = verify.verify_batch([VerifyCall(n, [5, 6]) for n in ("ok", "doomed", "ok2")])
    assert isinstance(failed, RuntimeError)
    assert verify.sessions.get("doomed").cache.seq_len == before
    monkeypatch.setattr(services.verify, "logits_to_probs", real)
    assert ok == alone.verify("ok", [5, 6]) and ok2.token_ids == alone.verify("ok2", [5, 6]).token_ids
