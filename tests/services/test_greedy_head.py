"""kernels.greedy_head and FastLlamaRunner.argmax: a greedy row's argmax through a bfloat16 screen is the argmax of
the float32 logits that kernels.skinny_gemm computes — on flat and peaked rows, exact ties and 1-ulp near-ties, odd
widths, up to 32 rows — and a greedy session's pass gives the same ids as its logits would.

The kernel is built on AVX512_BF16 CPUs only; elsewhere ``argmax`` takes the logits' argmax. The pass-level tests run
that path on every CPU (``SPLITSPEC_NO_GREEDY_HEAD`` forces it), and the kernel's too where it is built, so that CI
checks greedy ids whatever its CPU."""

import pytest
import torch

from services import kernels
from services.fast_llama import FastLlamaRunner
from services.runner import make_runner

needs_kernel = pytest.mark.skipif(kernels.greedy_head() is None, reason="greedy_head is built on AVX512_BF16 CPUs only")
PATHS = [pytest.param("kernel", marks=needs_kernel), "logits"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The greedy ids' path of runners made in the test: the kernel, or the logits' argmax (a CPU without it)."""
    if request.param == "logits":
        monkeypatch.setenv(kernels.NO_GREEDY_HEAD_ENV, "1")
    return request.param


def _argmax(x, weight):
    """(greedy_head's ids and candidate counts, the argmax of skinny_gemm's logits)."""
    packed = kernels.pack_weight(weight)
    ids, counts = kernels.greedy_head()(x, kernels.pack_screen(weight), packed, kernels.row_norms(weight), weight.shape[0])
    return ids, counts, kernels.skinny_gemm()(x, packed, weight.shape[0]).argmax(-1)


@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 32])
@pytest.mark.parametrize("inputs", [136, 135])  # (an odd width: the last pair half zero)
@needs_kernel
def test_the_argmax_of_the_skinny_logits_flat_and_peaked(rows, inputs):
    gen = torch.Generator().manual_seed(rows * 1000 + inputs)
    weight = torch.randn(3001, inputs, generator=gen) * 0.05
    flat = torch.randn(rows, inputs, generator=gen)  # many logits within the bound of the largest
    peaked = flat + 4.0 * weight[torch.randint(0, 3001, (rows,), generator=gen)] / 0.05  # one stands out
    for x in (flat, peaked):
        ids, counts, expected = _argmax(x, weight)
        assert torch.equal(ids, expected)
        assert bool((counts >= 1).all())
    assert int(counts.max()) < 50  # (the peaked rows: a few candidates, not the vocabulary)


@needs_kernel
def test_the_same_ids_with_several_torch_threads():
    """The screen's panels split across torch's threads (at::parallel_for): the same ids as with one."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(4001, 96, generator=gen) * 0.05  # (126 panels)
    x = torch.randn(13, 96, generator=gen)
    one = _argmax(x, weight)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = _argmax(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two[0], one[0]) and torch.equal(two[0], one[2]) and torch.equal(two[1], one[1])


@needs_kernel
def test_exact_ties_go_to_the_first_and_one_ulp_decides():
    """Two equal rows of the weight: torch.argmax's first of the largest. Rows a few ulps apart: the float32 logits
    decide (the screen cannot tell them apart)."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(500, 64, generator=gen) * 0.05
    x = torch.randn(4, 64, generator=gen)
    best = int(kernels.skinny_gemm()(x[:1], kernels.pack_weight(weight), 500).argmax())
    weight[17], weight[best] = weight[best].clone(), weight[best]  # 17 (lower, unless best is) ties with best
    ids, _, expected = _argmax(x, weight)
    assert torch.equal(ids, expected) and int(ids[0]) == min(17, best)
    for step in range(1, 6):  # scaled up by a few ulps: the larger logit (usually) wins, as float32 says
        weight[300] = weight[17] * (1 + step * 2.0**-23)
        ids, counts, expected = _argmax(x, weight)
        assert torch.equal(ids, expected) and int(counts[0]) >= 2


@needs_kernel
def test_a_row_that_is_not_finite_or_too_large_is_left_to_the_logits(tiny):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    x[1, 5] = float("nan")
    x[2, 7] = 1e36  # (finite, but a product could overflow: not screened either)
    ids, _, _ = _argmax(x, weight)
    assert ids.tolist()[1:] == [-1, -1] and int(ids[0]) >= 0
    zero = torch.zeros(1, 32)  # every logit 0: every id a candidate, the first wins
    assert _argmax(zero, weight)[0].tolist() == [0]
    huge = torch.zeros(1, 32)
    huge[0, 0] = 1e38  # (beyond bfloat16's range with any weight: not screened)
    assert _argmax(huge, weight * 1e-45)[0].tolist() == [-1]
    runner = make_runner(tiny[0])
    features = torch.randn(3, runner.head.weight_t.shape[0], generator=gen)
    features[1, 0] = float("inf")
    assert torch.equal(runner.argmax(features), runner._head(features).argmax(-1))


def test_greedy_chunks_get_their_logits_argmax_in_a_mixed_pass(tiny, path):
    """forward_batch(greedy=...): greedy sequences, a tree and a sampled session in one pass, and prefill's
    last rows: each greedy chunk's ids are its logits' argmax, the others' logits unchanged."""
    from services.tree import DraftTree

    target, _ = tiny
    runner = make_runner(target)
    assert isinstance(runner, FastLlamaRunner) and (runner._greedy_screen() is not None) == (path == "kernel")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in (9, 14, 5, 6)]
    rows = [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in (1, 4, 7, 3)]
    trees = [None, None, DraftTree((0, 0, 1, 1, 2, 0)), None]

    def one_pass(greedy, last_only=False):
        caches = []
        for prompt in prompts:
            caches.append(runner.new_cache())
            runner.forward(prompt, caches[-1])
        return runner.forward_batch(list(zip(rows, caches)), trees=trees, greedy=greedy, last_only=last_only)

    for last_only in (False, True):
        logits, features = one_pass(None, last_only)
        ids, same_features = one_pass([True, False, True, True], last_only)
        for flag, got, expected in zip([True, False, True, True], ids, logits):
            assert torch.equal(got, expected.argmax(-1) if flag else expected)
        assert all(torch.equal(a, b) for a, b in zip(features, same_features))


@needs_kernel
def test_default_targets_greedy_decoding_is_unchanged(default_pair):
    """The default target decoding greedily, every step's id through the screen and through the full logits."""
    target, _ = default_pair
    runner = make_runner(target)
    cache = runner.new_cache()
    token, candidates = torch.tensor([1, 504, 3458, 282, 260, 2362, 30]), []  # (a short opening)
    for _ in range(48):
        (logits,), (features,) = runner.forward_batch([(token, cache)])
        ids, counts = kernels.greedy_head()(features[-1:], *runner._greedy_screen(), runner.head.out_features)
        assert int(ids[0]) == int(logits[-1].argmax())
        candidates.append(int(counts[0]))
        token = ids
    assert sorted(candidates)[len(candidates) // 2] <= 8, candidates  # (a handful: the screen pays)


def test_greedy_speculation_equals_the_target_alone(tiny, path):
    """Engines made on this path (prefill's first token, the verifier's ids, the drafter's): greedy output with
    drafts is the target's own."""
    from services.draft import DraftEngine
    from services.loop import generate
    from services.prefill import PrefillEngine
    from services.sampling import SamplingParams
    from services.verify import VerifyEngine
    from tests.conftest import greedy_reference

    target, draft = tiny
    engines = PrefillEngine(target), DraftEngine(draft), VerifyEngine(target)
    assert (engines[2].runner._greedy_screen() is not None) == (path == "kernel")
    for prompt in ([1, 5, 7, 9], [1, 30, 31, 32, 33]):
        result = generate(*engines, prompt, max_new_tokens=24, num_draft_tokens=3, params=SamplingParams(),
                          drafter="model", tree_width=3)
        assert result.token_ids == greedy_reference(target.model, prompt, 24)
