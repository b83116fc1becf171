"""The compact Llama forward computes what transformers' forward computes."""

import pytest
import torch

from services.fast_llama import FastLlamaRunner, supports
from services.hf_runner import ModelRunner, cache_kwarg
from services.runner import make_runner


def test_tiny_pair_takes_the_fast_path(tiny):
    assert supports(tiny[0].config)
    assert isinstance(make_runner(tiny[0]), FastLlamaRunner)
    assert isinstance(make_runner(tiny[0], fast=False), ModelRunner)


def test_generic_runner_hands_its_cache_to_the_forward_under_either_name(tiny):
    """transformers renamed the forward's ``past_key_values`` to ``cache``; an unknown name is swallowed by
    ``**kwargs`` and the cache stays empty (seen with transformers 5.17 on a GPU machine)."""

    class OldForward(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return input_ids

    assert cache_kwarg(OldForward()) == "past_key_values"
    assert cache_kwarg(tiny[0].model) in ("cache", "past_key_values")
    runner = ModelRunner(tiny[0])
    cache = runner.new_cache()
    runner.forward(torch.tensor([1, 5, 7]), cache)
    assert cache.seq_len == 3


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
    packed = kernels.pack_weight(weight)
    x = torch.randn(27, 136, generator=gen)  # (three blocks of rows)
    batched = kernel(x, packed, 303)
    for row in range(27):
        assert torch.equal(kernel(x[row : row + 1], packed, 303), batched[row : row + 1]), row
    for rows in (slice(3, 10), slice(0, 12), slice(2, 15)):  # one block, a full one, two
        assert torch.equal(kernel(x[rows], packed, 303), batched[rows]), rows


def test_skinny_kernel_sums_each_product_input_by_input():
    """Every output is one fused multiply-add per input, in input order (no other order on any path, vector width
    or blocking): the same bits as that sum computed one column at a time."""
    from services import kernels

    kernel = kernels.skinny_gemm()
    if kernel is None:
        pytest.skip("no compiled kernel here: BLAS fallback")
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 40, generator=gen)
    x = torch.randn(9, 40, generator=gen)
    y = kernel(x, kernels.pack_weight(weight), 70)
    expected = torch.zeros(9, 70)
    for i in range(40):  # a float32 FMA: the exact product plus the sum, rounded once to float32 (in float64 the
        # product is exact; rounding the sum to float64 first differs only in rare double-rounding cases, ~2^-29 each)
        expected = torch.addcmul(expected.double(), x[:, i : i + 1].double(), weight[:, i].double()).float()
    assert torch.equal(y, expected)


def test_skinny_kernel_builds_here():
    """The compiled verify-chunk kernel is available on this machine (AVX2 CPUs)."""
    from services import kernels

    if not {"avx2", "fma"} <= kernels._cpu_flags():
        pytest.skip("CPU without AVX2/FMA: BLAS fallback is used")
    assert kernels.skinny_gemm() is not None


def _attention_case(seed: int, head_dim: int = 24, heads: int = 4, kv_heads: int = 2):
    """Three sequences' short chunks (1, 5 and 3 rows) at different cache lengths, plus their caches."""
    gen = torch.Generator().manual_seed(seed)
    sizes, starts = [1, 5, 3], [0, 37, 16]
    total = sum(sizes)
    q = torch.randn(heads, total, head_dim, generator=gen)
    k = torch.randn(kv_heads, total, head_dim, generator=gen)
    v = torch.randn(kv_heads, total, head_dim, generator=gen)
    caches = [torch.randn(2, 2, kv_heads, start + n + 4, head_dim, generator=gen) for start, n in zip(starts, sizes)]
    offsets = [sum(sizes[:c]) for c in range(len(sizes))]
    return q, k, v, caches, offsets, sizes, starts


def test_decode_attention_appends_kv_and_attends_causally():
    """The compiled short-chunk attention: each chunk's K/V lands in its cache, and each row's attention is SDPA's
    over every cached position and the chunk's rows up to its own (odd head size: the vector tails)."""
    from services import kernels

    attend = kernels.decode_attention()
    if attend is None:
        pytest.skip("no compiled kernel here: SDPA is used")
    q, k, v, caches, offsets, sizes, starts = _attention_case(0)
    before = [cache.clone() for cache in caches]
    layer, scale = 1, 24**-0.5
    out = torch.empty(q.shape[1], q.shape[0] * q.shape[2])
    attend(out, q, k, v, caches, offsets, sizes, starts, layer, scale)
    for c, (offset, n, start) in enumerate(zip(offsets, sizes, starts)):
        end = start + n
        assert torch.equal(caches[c][layer, 0, :, start:end], k[:, offset : offset + n])
        assert torch.equal(caches[c][layer, 1, :, start:end], v[:, offset : offset + n])
        assert torch.equal(caches[c][0], before[c][0])  # other layers untouched
        mask = torch.ones(n, end, dtype=torch.bool).tril_(diagonal=start)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[None, :, offset : offset + n], caches[c][None, layer, 0, :, :end], caches[c][None, layer, 1, :, :end],
            attn_mask=mask, scale=scale, enable_gqa=True,
        )[0].transpose(0, 1).reshape(n, -1)  # [n, h * d]
        torch.testing.assert_close(out[offset : offset + n], expected, rtol=1e-5, atol=1e-5)


def test_decode_attention_rows_do_not_depend_on_their_batch():
    """A chunk's attention is bit-identical alone and batched with other sequences' chunks."""
    from services import kernels

    attend = kernels.decode_attention()
    if attend is None:
        pytest.skip("no compiled kernel here: SDPA is used")
    q, k, v, caches, offsets, sizes, starts = _attention_case(1)
    batched = torch.empty(q.shape[1], q.shape[0] * q.shape[2])
    attend(batched, q, k, v, [cache.clone() for cache in caches], offsets, sizes, starts, 0, 0.2)
    for c, (offset, n, start) in enumerate(zip(offsets, sizes, starts)):
        rows = slice(offset, offset + n)
        alone = torch.empty(n, q.shape[0] * q.shape[2])
        attend(alone, q[:, rows], k[:, rows], v[:, rows], [caches[c].clone()], [0], [n], [start], 0, 0.2)
        assert torch.equal(alone, batched[rows]), c


def test_forward_without_compiled_kernels_gives_the_same_logits(tiny, monkeypatch):
    """The SDPA fallback (no compiler, or SPLITSPEC_NO_KERNELS) and the compiled attention agree."""
    from services import kernels

    target, _ = tiny
    runner = make_runner(target)
    ids = torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(2))

    def logits():
        cache = runner.new_cache()
        return torch.cat([runner.forward(ids[:7], cache), runner.forward(ids[7:10], cache), runner.forward(ids[10:], cache)])

    with_kernels = logits()
    monkeypatch.setattr(kernels, "decode_attention", lambda: None)
    torch.testing.assert_close(logits(), with_kernels, rtol=1e-5, atol=1e-5)


def test_decoder_layers_in_one_call_give_the_python_loops_bits(tiny, monkeypatch):
    """Short chunks go through ``kernels.decoder_layers`` (the layer loop in C++, without the GIL): the same logits,
    features and cached K/V, bit for bit, as the Python loop, for sequences and a draft tree in one pass."""
    from services import kernels
    from services.tree import DraftTree

    if kernels.decoder_layers() is None:
        pytest.skip("the compiled kernels are not available on this machine")
    target, _ = tiny
    runner = make_runner(target)
    assert runner.packed_layers is not None
    calls = []
    compiled = kernels.decoder_layers()
    monkeypatch.setattr(kernels, "decoder_layers", lambda: lambda *args: calls.append(1) or compiled(*args))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in (9, 14, 5)]
    rows = [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in (1, 4, 7)]
    trees = [None, None, DraftTree((0, 0, 1, 1, 2, 0))]

    def one_pass(fused: bool):
        monkeypatch.setattr(FastLlamaRunner, "fused", fused)
        caches = []
        for prompt in prompts:
            caches.append(runner.new_cache())
            runner.forward(prompt, caches[-1])
        logits, features = runner.forward_batch(list(zip(rows, caches)), trees=trees)
        return logits, features, [cache.buffer[..., : cache.seq_len, :].clone() for cache in caches]

    fused = one_pass(True)
    assert len(calls) == 4  # (the short prompts, then the pass)
    python = one_pass(False)
    assert len(calls) == 4
    for got, expected in zip(fused, python):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
