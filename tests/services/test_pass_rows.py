"""Passes of more than SKINNY_MAX_ROWS (32) rows: every session's rows are the same bits as alone (issue 37).

Up to 32 rows a pass, the compact forward's matmuls run through the row-independent skinny kernel; beyond, a BLAS
GEMM over all the rows computed them, its rounding depending on the neighbours: a greedy near-tie or a seeded
sample (its q and p) could change with the load. A pass now runs in groups of at most 32 rows
(``kernels.row_groups``), for the target's verify and prefill passes, the draft model's and the EAGLE head's."""

import pytest
import torch

from services import kernels
from services.draft import DraftEngine, ProposeCall
from services.prefill import PrefillEngine
from services.runner import make_runner
from services.tree import DraftTree
from services.sampling import SamplingParams
from tests.services.test_batched_draft import _equal

# (the default pair: on the tiny pair's 64-wide rows BLAS happens to round as the kernel does)
pytestmark = [pytest.mark.skipif(kernels.skinny_gemm() is None, reason="the compact forward needs the kernels"),
              pytest.mark.slow]
PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5), SamplingParams(temperature=1.2, seed=9)]


def test_row_groups():
    assert kernels.row_groups([8, 8, 8, 8, 8]) == [[0, 1, 2, 3], [4]]
    assert kernels.row_groups([5, 40, 3, 30]) == [[0], [1], [2], [3]]
    assert kernels.row_groups([1] * 33) == [list(range(32)), [32]]
    assert kernels.row_groups([]) == []


@pytest.mark.parametrize("greedy", [False, True])
def test_a_pass_of_many_rows_gives_each_chunk_its_bits_alone(default_pair, greedy):
    target, _ = default_pair
    runner = make_runner(target)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in (9, 14, 5, 6, 11, 7, 40)]
    rows = [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in (8, 8, 7, 8, 8, 6, 3)]  # 48 rows
    trees = [None, DraftTree((0, 0, 1, 1, 2, 0, 3)), None, None, None, DraftTree((0, 1, 2, 0, 0)), None]

    def caches():
        out = []
        for prompt in prompts:
            out.append(runner.new_cache())
            runner.forward(prompt, out[-1])
        return out

    flags = [greedy] * len(rows)
    logits, features = runner.forward_batch(list(zip(rows, caches())), trees=trees, greedy=flags)
    for i, cache in enumerate(caches()):
        (alone,), (alone_features,) = runner.forward_batch([(rows[i], cache)], trees=[trees[i]], greedy=[greedy])
        assert torch.equal(logits[i], alone) and torch.equal(features[i], alone_features), i
    # a prompt's chunk of more than 32 rows in the pass: alone in its group, its last row's logits as alone
    long = torch.randint(0, target.vocab_size, (45,), generator=gen)
    chunks = list(zip([*rows[:3], long], [*caches()[:3], runner.new_cache()]))
    logits, _ = runner.forward_batch(chunks, last_only=[False, False, False, True])
    assert torch.equal(logits[3], runner.forward(long, runner.new_cache(), last_only=True))


def test_draft_passes_of_many_rows_propose_what_they_propose_alone(default_pair):
    """Twelve sessions (the shipped EAGLE head and the draft model, greedy and seeded sampled): their first pass has
    over 32 EAGLE rows; every batched proposal, its q included, equals the one alone."""
    from services.eagle_draft import installed_head

    target, draft = default_pair
    head, prefill = installed_head(draft, target), PrefillEngine(target)
    alone, batched = DraftEngine(draft, eagle_head=head), DraftEngine(draft, eagle_head=head)
    gen = torch.Generator().manual_seed(8)
    prompts = [[1] + torch.randint(100, 40000, (4 + i % 5,), generator=gen).tolist() for i in range(12)]
    drafters = ["eagle", "eagle", "model"] * 4
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    for i, (prompt, p, drafter) in enumerate(zip(prompts, params, drafters)):
        features = prefill.prefill(prompt, p, features=True).features if drafter == "eagle" else None
        for engine in (alone, batched):
            engine.start(f"s{i}", prompt, p, drafter, features)
    hidden = target.config.hidden_size
    verdicts = {i: [(0, 260 + i, None)] for i in range(len(prompts))}
    for step in range(3):
        calls = [ProposeCall(f"s{i}", k=1 + (i + step) % 4, accepts=list(verdicts[i])) for i in range(len(prompts))]
        expected = [alone.propose(c.request_id, c.k, accepts=c.accepts) for c in calls]
        got = batched.propose_batch(calls)
        for i, (want, have) in enumerate(zip(expected, got)):
            assert not isinstance(have, Exception), have
            assert _equal(want, have), (step, i)
            n = min(len(want.token_ids), (i + step) % 3)  # a made-up verdict: some drafts accepted, then a token
            features = torch.randn(n + 1, hidden, generator=torch.Generator().manual_seed(100 * i + step)).bfloat16()
            verdicts[i] = [(n, 300 + 7 * i + step, features)]
