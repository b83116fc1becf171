"""A drafter's matmul weights kept as bfloat16 (models.draft_weights): the kernel, the Linear, and losslessness."""

import pytest
import torch

from services import kernels
from services.draft import DraftEngine, ProposeCall
from services.fast_llama import Linear, weights_as
from services.loop import generate
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.verify import VerifyEngine
from tests.conftest import greedy_reference
from tests.services.test_eagle_drafter import random_head
from tests.services.test_engine import NEW_TOKENS, PROMPTS


def _kernel():
    kernel = kernels.skinny_gemm()
    if kernel is None:
        pytest.skip("no compiled kernel here: BLAS fallback")
    return kernel


def test_bfloat16_panels_give_the_float32_kernel_of_the_rounded_weight():
    """Widening a bfloat16 weight as it is loaded is exact: the same bits as the float32 kernel over the
    bfloat16-rounded weight, for every block of rows, and a row's result alone equals it batched."""
    kernel = _kernel()
    gen = torch.Generator().manual_seed(0)
    weight = weights_as(torch.randn(303, 136, generator=gen), torch.bfloat16)  # (the last panel partial)
    as_bf16, as_f32 = kernels.pack_weight(weight, torch.bfloat16), kernels.pack_weight(weight)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(_unpacked(as_bf16, 303).float(), weight)
    assert torch.equal(_unpacked(as_f32, 303), weight)
    x = torch.randn(13, 136, generator=gen)
    for rows in (1, 2, 5, 6, 7, 12, 13):  # (the two layouts block their rows differently: the same bits)
        assert torch.equal(kernel(x[:rows], as_bf16, 303), kernel(x[:rows], as_f32, 303)), rows
    batched = kernel(x, as_bf16, 303)
    for row in range(13):
        assert torch.equal(kernel(x[row : row + 1], as_bf16, 303), batched[row : row + 1]), row
    torch.testing.assert_close(batched, x @ weight.T, rtol=1e-5, atol=1e-4)


def _unpacked(packed: torch.Tensor, out: int) -> torch.Tensor:  # [panels, in, width] -> [out, in]
    panels, inputs, width = packed.shape
    return packed.transpose(1, 2).reshape(panels * width, inputs)[:out]


def test_linear_with_bfloat16_storage():
    """Every call of a Linear kept as bfloat16 computes with the same rounded values, float32 products and sums;
    the storage halves the kernel's bytes; other precisions are refused."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(100, 48, generator=gen)
    rounded = weight.bfloat16().float()
    linear = Linear(weight, torch.bfloat16)
    assert torch.equal(linear.weight_t, rounded.t())
    if linear.packed is not None:
        assert linear.packed.dtype == torch.bfloat16
        assert linear.packed.nbytes == Linear(weight).packed.nbytes // 2
    for rows in (1, 4, 40):  # kernel / autotuned BLAS / long chunk
        x = torch.randn(rows, 48, generator=gen)
        torch.testing.assert_close(linear(x), x @ rounded.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(weights_as(weight, None), weight) and torch.equal(weights_as(weight.double(), torch.bfloat16), weight.double())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        Linear(weight, torch.float16)


@pytest.fixture(scope="module")
def engines(tiny):
    """Prefill, a draft engine whose draft model and EAGLE head keep bfloat16 weights, and verify."""
    target, draft = tiny
    drafts = DraftEngine(draft, eagle_head=random_head(target), weight_storage=torch.bfloat16)
    return PrefillEngine(target), drafts, VerifyEngine(target)


@pytest.mark.parametrize("drafter,k,width", [("model", 2, 1), ("model", 1, 3), ("eagle", 3, 1), ("eagle", 2, 3)])
def test_greedy_with_bfloat16_drafters_equals_target_alone(tiny, engines, drafter, k, width):
    """The drafts change with the drafter's precision, never the answer: greedy output is the target's alone."""
    target, _ = tiny
    prefill, drafts, verify = engines
    head = drafts.eagle_head._linears
    assert head.lm_head.weight_t.equal(weights_as(head.lm_head.weight_t, torch.bfloat16))  # (the head is rounded)
    accepted = 0
    for prompt in PROMPTS:
        result = generate(prefill, drafts, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                          params=SamplingParams(), drafter=drafter, tree_width=width)
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), (drafter, prompt)
        accepted += result.stats.accepted
    assert accepted > 0


def test_seeded_sampling_with_bfloat16_drafters_reproduces(engines):
    """A seeded sampled request gives the same answer twice (q is the bfloat16 drafter's, used as drafted)."""
    prefill, drafts, verify = engines
    params = SamplingParams(temperature=0.9, seed=11)
    runs = [generate(prefill, drafts, verify, PROMPTS[0], max_new_tokens=24, num_draft_tokens=2, params=params,
                     drafter=drafter).token_ids for drafter in ("model", "model", "eagle", "eagle")]
    assert runs[0] == runs[1] and runs[2] == runs[3]


def test_batched_bfloat16_proposals_equal_proposals_alone(tiny):
    """Batched drafting stays batch-invariant with bfloat16 weights: each session drafts what it drafts alone."""
    target, draft = tiny
    head, prefill = random_head(target), PrefillEngine(target)
    alone, batched = (DraftEngine(draft, eagle_head=head, weight_storage=torch.bfloat16) for _ in range(2))
    params = SamplingParams()
    for i, prompt in enumerate(PROMPTS[:4]):
        drafter = ("eagle", "model")[i % 2]
        features = prefill.prefill(prompt, params, features=True).features if drafter == "eagle" else None
        for engine in (alone, batched):
            engine.start(f"s{i}", prompt, params, drafter, features)
    calls = [ProposeCall(f"s{i}", k=1 + i % 3, accepts=[(0, 3 + i, None)]) for i in range(4)]
    expected = [alone.propose(c.request_id, c.k, accepts=c.accepts) for c in calls]
    got = batched.propose_batch(calls)
    assert [p.token_ids for p in got] == [p.token_ids for p in expected]
