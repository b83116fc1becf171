"""transformers' forward made batch-invariant (services.batch_invariant): the verifier of every GPU stage.

These run it on the CPU (the same code as on a GPU, torch's CPU kernels); scripts/gpu-check.sh runs the row
check on a GPU.
"""

import pytest
import torch

from services import fast_llama, kernels
from services.batch_invariant import PASS_ROWS, BatchInvariantRunner, StaticKVCache
from services.errors import InvalidRequestError
from services.hf_runner import ModelRunner
from services.loading import wrap_model
from services.loop import generate
from services.models.tiny import tiny_pair
from services.prefill import PrefillEngine
from services.runner import make_runner
from services.sampling import SamplingParams
from services.verify import VerifyCall, VerifyEngine
from tests.conftest import greedy_reference

PROMPT = torch.tensor([1, 5, 7, 9, 11, 13, 17, 19])
BLOCK = torch.tensor([31, 37, 41, 43, 47])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def target(request, tiny):
    if request.param == "float32":
        return tiny[0]
    model, _ = tiny_pair(seed=0)  # its own copy: the session's tiny pair stays float32
    return wrap_model(model.model.to(torch.bfloat16), model_id="tiny-bf16", dtype="bfloat16")


def _rows(runner, splits: list[int]) -> torch.Tensor:  # BLOCK's logits, computed in passes of these sizes
    cache = _open(runner, PROMPT.tolist())
    out, at = [], 0
    for n in splits:
        out.append(runner.forward(BLOCK[at : at + n], cache))
        at += n
    return torch.cat(out)


def test_a_row_is_the_same_bits_in_any_pass(target):
    """A verify block's logits, row for row, equal one-row steps' exactly, whatever the pass it shares."""
    runner = BatchInvariantRunner(target, capacity=128)
    steps = _rows(runner, [1] * len(BLOCK))
    for splits in ([5], [2, 3], [4, 1]):
        assert torch.equal(_rows(runner, splits), steps), splits


def test_make_runner_picks_it_for_a_verifier(tiny, target):
    assert isinstance(make_runner(target, fast=False, batch_invariant=True), BatchInvariantRunner)
    assert type(make_runner(target, fast=False)) is ModelRunner  # prefill and drafts: no padding
    assert isinstance(VerifyEngine(target, fast=False).runner, BatchInvariantRunner)
    # on the CPU the compact forward verifies where it is batch-invariant itself: float32 with its kernels
    fast = fast_llama.batch_invariant(target.model.dtype)
    assert fast == (target.dtype == "float32" and kernels.skinny_gemm() is not None)
    assert isinstance(VerifyEngine(target).runner, fast_llama.FastLlamaRunner if fast else BatchInvariantRunner)
    assert isinstance(make_runner(target), fast_llama.FastLlamaRunner)  # prefill: the fastest, in any dtype


def test_architectures_whose_kv_does_not_fit_a_static_buffer_keep_the_plain_forward(tiny, caplog):
    """Sliding windows, latent KV (MLA): the verifier keeps transformers' forward and says it is not invariant."""
    import copy

    from services import batch_invariant

    target, _ = tiny
    assert batch_invariant.supports(target.config)
    for change in ({"sliding_window": 64}, {"kv_lora_rank": 16}, {"v_head_dim": 8}):
        config = copy.deepcopy(target.config)
        for name, value in change.items():
            setattr(config, name, value)
        assert not batch_invariant.supports(config), change
    windowed = copy.deepcopy(target)
    windowed.model.config.sliding_window = 64
    assert type(make_runner(windowed, fast=False, batch_invariant=True)) is ModelRunner
    assert "not batch-invariant" in caplog.text


def test_it_computes_what_transformers_computes(tiny):
    """Padding and the static buffer change the rounding only: logits close to transformers' own forward's."""
    target, _ = tiny
    plain, padded = ModelRunner(target), BatchInvariantRunner(target)
    ours = _rows(padded, [3, 2])
    theirs = _rows(plain, [3, 2])
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_kv_payload_round_trip_and_rollback(target):
    runner = BatchInvariantRunner(target, capacity=128)
    cache = runner.new_cache()
    runner.forward(PROMPT, cache)
    payload = cache.export(target.fingerprint)
    assert payload.seq_len == len(PROMPT) and payload.dtype == str(target.model.dtype).removeprefix("torch.")
    imported = runner.import_payload(payload)
    assert isinstance(imported, StaticKVCache) and imported.seq_len == len(PROMPT)
    # rollback: a rejected block leaves stale K/V past the length, which the mask hides — the same bits as never
    runner.forward(BLOCK, cache)
    cache.crop(len(PROMPT))
    assert torch.equal(runner.forward(BLOCK[:2], cache), runner.forward(BLOCK[:2], imported))


def test_it_adopts_a_prefill_from_the_dynamic_cache(tiny):
    """Prefill runs transformers' forward with its growing cache (on a GPU); the verifier takes its payload."""
    target, _ = tiny
    payload = PrefillEngine(target).prefill(PROMPT.tolist(), SamplingParams()).payload
    dynamic = ModelRunner(target).import_payload(payload)
    static = BatchInvariantRunner(target).import_payload(payload)
    assert torch.allclose(ModelRunner(target).forward(BLOCK, dynamic), BatchInvariantRunner(target).forward(BLOCK, static),
                          atol=1e-4, rtol=1e-4)


def test_greedy_equals_target_alone(tiny, tiny_engines):
    """The GPU path's verifier (on the CPU): speculative greedy output is the target's, at every k."""
    target, _ = tiny
    prefill, draft, _ = tiny_engines
    verify = VerifyEngine(target, fast=False)
    for prompt in ([1, 5, 7, 9, 11], [1, 20], [1, 30, 31, 32, 30, 31]):
        expected = greedy_reference(target.model, prompt, 32)
        for k in (1, 4, PASS_ROWS - 1):
            result = generate(prefill, draft, verify, prompt, max_new_tokens=32, num_draft_tokens=k, params=SamplingParams())
            assert result.token_ids == expected, (prompt, k)


def test_kv_capacity_bounds_a_session(tiny):
    """A session that would pass ``kv_capacity`` gets a clear error in its slot; the session beside it goes on."""
    target, _ = tiny
    prefill = PrefillEngine(target)
    verify = VerifyEngine(target, fast=False, kv_capacity=12)
    assert verify.max_context == 12
    for sid, prompt in (("long", [1, 2, 3, 4, 5, 6, 7, 8, 9]), ("short", [1, 2])):
        handed = prefill.prefill(prompt, SamplingParams())
        verify.open(sid, handed.payload, handed.first_token, SamplingParams())
    results = verify.verify_batch([VerifyCall("long", [4, 5, 6]), VerifyCall("short", [4, 5, 6])])
    assert isinstance(results[0], InvalidRequestError) and "remaining context" in str(results[0])
    assert results[1].token_ids
    with pytest.raises(InvalidRequestError, match="kv_capacity"):
        verify.open("too long", prefill.prefill(list(range(1, 15)), SamplingParams()).payload, 3, SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_new_tokens|context"):
        generate(prefill, None, verify, [1, 2, 3], max_new_tokens=16, num_draft_tokens=1, params=SamplingParams())


@pytest.mark.slow
def test_default_pair_in_bfloat16_keeps_the_token_that_moved():
    """transformers' forward on the CPU in bfloat16, before it was made batch-invariant, moved token 28 of this
    prompt at k = 4 (a k + 1-row pass rounded a near-tie otherwise than a one-row step; the GPU check's prompt 1)."""
    from services.draft import DraftEngine
    from services.loading import load_causal_lm
    from services.models import default_pair as dp
    from services.text import chat_ids

    target = load_causal_lm(dp.target_dir(), dtype="bfloat16")
    prefill, draft = PrefillEngine(target), DraftEngine(load_causal_lm(dp.drafter_dir(), dtype="bfloat16"))
    verify = VerifyEngine(target, fast=False, kv_capacity=256)
    assert isinstance(verify.runner, BatchInvariantRunner)
    prompt = chat_ids(target.tokenizer, "Write a short poem about the sea.")
    alone = generate(prefill, None, verify, prompt, max_new_tokens=32, num_draft_tokens=1, params=SamplingParams())
    speculative = generate(prefill, draft, verify, prompt, max_new_tokens=32, num_draft_tokens=4, params=SamplingParams())
    assert speculative.token_ids == alone.token_ids
    assert speculative.stats.accepted > 0


def _open(runner, prompt: list[int]):
    cache = runner.new_cache()
    runner.forward(torch.tensor(prompt), cache)
    return cache


def test_sessions_sharing_a_pass_keep_their_own_bits(target):
    """With slots, concurrent sessions' chunks share one forward; each session's logits are the bits it gets with
    empty slots beside it, whoever its neighbours are and whichever slot it takes."""
    runner = BatchInvariantRunner(target, capacity=128, slots=3)
    prompts = [PROMPT.tolist(), [1, 20, 21], [1, 30, 31, 32, 33]]
    chunks = [BLOCK, BLOCK[:2], BLOCK[1:]]
    alone = [runner.forward(chunk, _open(runner, prompt)) for prompt, chunk in zip(prompts, chunks)]
    for order in ([0, 1, 2], [2, 0, 1], [1, 2]):  # three sessions in one pass, in another order; two
        caches = {i: _open(runner, prompts[i]) for i in order}
        logits, _ = runner.forward_batch([(chunks[i], caches[i]) for i in order])
        for i, got in zip(order, logits):
            assert torch.equal(got, alone[i]), (order, i)
    # a prompt-length chunk in the same call runs in a pass of its own; the short ones keep their bits
    long = torch.arange(1, PASS_ROWS + 4)  # [20]
    mixed, features = runner.forward_batch([(long, runner.new_cache()), (BLOCK, _open(runner, prompts[0]))],
                                           last_only=[True, False])
    assert torch.equal(mixed[0], runner.forward(long, runner.new_cache(), last_only=True)) and mixed[0].shape[0] == 1
    assert torch.equal(mixed[1], alone[0]) and features[0].shape[0] == len(long)
    # more sessions than slots: two passes, the same bits; a greedy chunk gets its argmax
    caches = [_open(runner, prompts[i % 3]) for i in range(4)]
    ids, _ = runner.forward_batch([(chunks[i % 3], caches[i]) for i in range(4)], greedy=[True] * 4)
    assert [i.tolist() for i in ids] == [alone[i % 3].argmax(-1).tolist() for i in range(4)]


def test_greedy_with_slots_equals_target_alone(tiny, tiny_engines):
    target, _ = tiny
    prefill, draft, _ = tiny_engines
    verify = VerifyEngine(target, fast=False, pass_slots=4)
    assert verify.runner.slots == 4
    for prompt in ([1, 5, 7, 9, 11], [1, 30, 31, 32, 30, 31]):
        result = generate(prefill, draft, verify, prompt, max_new_tokens=24, num_draft_tokens=3, params=SamplingParams())
        assert result.token_ids == greedy_reference(target.model, prompt, 24), prompt
