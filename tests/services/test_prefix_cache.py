"""Prefix caching in prefill: a prompt that starts like a recent one reuses that prefix's KV and computes the rest;
what it returns equals a prefill without the cache (to float rounding), and greedy decoding is unchanged."""

import torch

from services.loop import generate
from services.prefill import PrefillCall, PrefillEngine, PrefillProgress
from services.prefix_cache import PREFIX_BLOCK, PrefixCache
from services.sampling import SamplingParams
from services.verify import VerifyEngine

SYSTEM = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]  # a shared opening, like a chat template's system turn
USERS = [[7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


def _assert_same(got, want):
    assert got.first_token == want.first_token
    assert got.payload.seq_len == want.payload.seq_len
    for a, b in zip(got.payload.keys + got.payload.values, want.payload.keys + want.payload.values):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-3, atol=1e-4)  # as chunked prefill
    assert (got.features is None) == (want.features is None)
    if got.features is not None:
        torch.testing.assert_close(got.features.float(), want.features.float(), rtol=2e-2, atol=2e-2)


def test_a_prompt_that_starts_like_a_cached_one_computes_only_the_rest(tiny):
    target, _ = tiny
    cached, plain = PrefillEngine(target, prefix_cache_bytes=2**20), PrefillEngine(target)
    for i, user in enumerate(USERS):
        prompt = SYSTEM + user
        for features in (False, True):
            got = cached.prefill(prompt, SamplingParams(), features=features)
            _assert_same(got, plain.prefill(prompt, SamplingParams(), features=features))
    cache = cached.prefix_cache
    # the first prompt found nothing, nor did it again with features (the cached KV came without them); every
    # later prefill reused the shared opening's whole blocks
    assert cache.hit_tokens == (len(USERS) * 2 - 2) * (len(SYSTEM) // PREFIX_BLOCK) * PREFIX_BLOCK
    assert cache.queried_tokens == sum(2 * len(SYSTEM + user) for user in USERS)


def test_the_same_prompt_again_computes_only_its_last_position(tiny):
    """The last position's logits give the first token: a hit is always shorter than the prompt, and for the same
    prompt again it is all but that position, block-aligned or not."""
    target, _ = tiny
    engine = PrefillEngine(target, prefix_cache_bytes=2**20)
    for prompt in (SYSTEM[:8], SYSTEM[:10]):  # a multiple of the block, and not
        first = engine.prefill(prompt, SamplingParams(temperature=1.0, seed=3))
        hits = engine.prefix_cache.hit_tokens
        again = engine.prefill(prompt, SamplingParams(temperature=1.0, seed=3))
        assert engine.prefix_cache.hit_tokens - hits == len(prompt) - 1
        _assert_same(again, first)


def test_greedy_decoding_is_unchanged_by_the_prefix_cache(tiny):
    target, draft = tiny
    from services.draft import DraftEngine

    cached, plain = PrefillEngine(target, prefix_cache_bytes=2**20), PrefillEngine(target)
    verify, drafts = VerifyEngine(target), DraftEngine(draft)
    for user in USERS * 2:
        prompt = SYSTEM + user
        for k in (0, 2):
            engine = drafts if k else None
            want = generate(plain, engine, verify, prompt, max_new_tokens=24, num_draft_tokens=max(k, 1), params=SamplingParams())
            got = generate(cached, engine, verify, prompt, max_new_tokens=24, num_draft_tokens=max(k, 1), params=SamplingParams())
            assert got.token_ids == want.token_ids
    assert cached.prefix_cache.hit_tokens > 0


def test_a_long_prompt_chunked_after_a_hit(tiny):
    """A hit, then the rest in chunks that continue where the cached prefix ends."""
    target, _ = tiny
    engine, plain = PrefillEngine(target, prefix_cache_bytes=2**20), PrefillEngine(target)
    engine.prefill(SYSTEM + [5], SamplingParams())
    prompt = SYSTEM + [(7 * i) % 90 + 3 for i in range(30)]
    call = PrefillCall(prompt, SamplingParams(), request_id="long", chunk=8)
    starts = []
    while isinstance(result := engine.prefill_batch([call])[0], PrefillProgress):
        starts.append(result.done)
        call = PrefillCall(prompt, SamplingParams(), request_id="long", chunk=8, start=result.done)
    assert starts[0] == len(SYSTEM) + 8  # the cached opening, then one chunk
    _assert_same(result, plain.prefill(prompt, SamplingParams()))


def test_features_are_reused_only_where_they_were_computed(tiny):
    target, _ = tiny
    engine = PrefillEngine(target, prefix_cache_bytes=2**20)
    engine.prefill(SYSTEM + USERS[0], SamplingParams())  # no features kept
    assert engine.prefix_cache.lookup(SYSTEM + USERS[1], features=True) is None
    assert engine.prefix_cache.lookup(SYSTEM + USERS[1]).length == len(SYSTEM) // PREFIX_BLOCK * PREFIX_BLOCK


def test_the_least_recently_used_prompts_go_first(tiny):
    target, _ = tiny
    engine = PrefillEngine(target)
    payloads = [engine.prefill([i + 2] * 12, SamplingParams()).payload for i in range(3)]
    cache = PrefixCache(max_bytes=2 * payloads[0].nbytes)
    for i, payload in enumerate(payloads[:2]):
        cache.insert([i + 2] * 12, payload)
    assert cache.lookup([2] * 12) is not None  # the first prompt is now the most recently used
    cache.insert([4] * 12, payloads[2])
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes
    assert cache.lookup([3] * 12) is None  # the second went
    assert cache.lookup([2] * 12) is not None and cache.lookup([4] * 12) is not None


def test_a_prompt_that_differs_inside_a_block_reuses_every_token_before_it(tiny):
    target, _ = tiny
    engine = PrefillEngine(target)
    cache = PrefixCache(max_bytes=2**20)
    prompt = list(range(3, 23))
    cache.insert(prompt, engine.prefill(prompt, SamplingParams()).payload)
    other = prompt[:10] + [90] + prompt[11:]
    hit = cache.lookup(other)
    assert hit.length == 10  # the whole blocks, then the tokens of the next one that match
    assert hit.payload.seq_len == hit.length and all(k.shape[1] == hit.length for k in hit.payload.keys)
    assert cache.lookup(prompt[:6] + [90]).length == 6  # a shorter prompt: at most all but its last position
    assert cache.lookup(prompt + [90, 91]).length == len(prompt)  # a longer one: the stored prompt, all of it
    assert cache.lookup(prompt[:3] + [90]) is None  # no whole block in common
