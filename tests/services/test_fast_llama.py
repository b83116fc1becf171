"""The compact Llama forward computes what transformers' forward computes."""

import pytest
import torch

from services.fast_llama import FastLlamaRunner, supports
from services.runner import ModelRunner, make_runner


def test_tiny_pair_takes_the_fast_path(tiny):
    assert supports(tiny[0].config)
    assert isinstance(make_runner(tiny[0]), FastLlamaRunner)
    assert isinstance(make_runner(tiny[0], fast=False), ModelRunner)


@pytest.mark.parametrize("chunks", [[7], [5, 1, 1, 1], [3, 4, 2], [6, 9, 1]])
def test_logits_match_transformers_chunk_by_chunk(tiny, chunks):
    """Prefill then decode/verify-sized chunks: same logits as the transformers forward."""
    target, _ = tiny
    fast, slow = make_runner(target), ModelRunner(target)
    fc, sc = fast.new_cache(), slow.new_cache()
    ids = torch.randint(0, target.vocab_size, (sum(chunks),), generator=torch.Generator().manual_seed(0))
    start = 0
    for n in chunks:
        chunk = ids[start : start + n]
        torch.testing.assert_close(fast.forward(chunk, fc), slow.forward(chunk, sc), rtol=1e-4, atol=1e-4)
        start += n


def test_crop_then_forward_matches_fresh(tiny):
    """Rolling back by a length, then writing over the rejected positions, is exact."""
    target, _ = tiny
    runner = make_runner(target)
    cache = runner.new_cache()
    runner.forward(torch.tensor([1, 2, 3, 4, 5, 6]), cache)
    cache.crop(3)
    rolled = runner.forward(torch.tensor([9, 8]), cache)
    fresh = runner.forward(torch.tensor([1, 2, 3, 9, 8]), runner.new_cache())[-2:]
    torch.testing.assert_close(rolled, fresh, rtol=1e-5, atol=1e-5)


def test_cache_grows_past_initial_capacity(tiny):
    target, _ = tiny
    runner = make_runner(target)
    cache = runner.new_cache()
    capacity = cache.buffer.shape[3]
    ids = torch.randint(0, target.vocab_size, (capacity + 10,), generator=torch.Generator().manual_seed(1))
    runner.forward(ids[: capacity - 2], cache)
    out = runner.forward(ids[capacity - 2 :], cache)
    ref = ModelRunner(target).forward(ids, ModelRunner(target).new_cache())[capacity - 2 :]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 32])
def test_every_matmul_variant_computes_x_times_w_transposed(rows):
    """Whichever variant the autotuner picks, the product is the same."""
    from services.fast_llama import Linear

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(303, 136, generator=gen)  # odd sizes: exercises the kernel's tails
    x = torch.randn(rows, 136, generator=gen)
    linear = Linear(weight)
    expected = x @ weight.t()
    for name, fn in linear.variants(rows).items():
        torch.testing.assert_close(fn(x), expected, rtol=1e-5, atol=1e-4, msg=name)


def test_skinny_kernel_rows_do_not_depend_on_their_batch():
    """A row's product is bit-identical alone and batched with others (batched verification relies on it)."""
    from services import kernels

    kernel = kernels.skinny_gemm()
    if kernel is None:
        pytest.skip("no compiled kernel here: BLAS fallback")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(303, 136, generator=gen)
    x = torch.randn(13, 136, generator=gen)
    batched = kernel(x, weight)
    for row in range(13):
        assert torch.equal(kernel(x[row : row + 1], weight), batched[row : row + 1]), row
    assert torch.equal(kernel(x[3:10], weight), batched[3:10])


def test_skinny_kernel_builds_here():
    """The compiled verify-chunk kernel is available on this machine (AVX2 CPUs)."""
    from services import kernels

    if not {"avx2", "fma"} <= kernels._cpu_flags():
        pytest.skip("CPU without AVX2/FMA: BLAS fallback is used")
    assert kernels.skinny_gemm() is not None
