"""EAGLE head: chained drafting is causal, the incremental session equals the batched chain, the walk counts right."""

import pytest
import torch
from transformers import LlamaForCausalLM

from services.models import eagle
from services.models.tiny import tiny_config
from services.training import acceptance, eagle_train


@pytest.fixture(scope="module")
def tiny_rows():
    """A tiny target and rows shaped like self-instruct data (ids, features, teacher top-K)."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_config(4)).eval()
    rows = []
    for n in (24, 30, 27, 33):
        ids = torch.randint(4, 96, (n,), dtype=torch.int32)
        with torch.no_grad():
            out = target(input_ids=ids[None].long(), output_hidden_states=True)
        hs, p = out.hidden_states, 8
        values, index = torch.log_softmax(out.logits[0], -1).topk(8, -1)
        rows.append({"ids": ids, "prompt_len": p, "final": hs[-1][0, :-1].bfloat16(),
                     "fused": torch.cat(hs[1:4], -1)[0, :-1].bfloat16(),
                     "top_idx": index[p - 1 : -1].int(), "top_logp": values[p - 1 : -1].half()})
    return target, rows


def _head(target, rows, feature, vocab=48):
    cfg = eagle.EagleConfig(feature=feature, draft_vocab=vocab, batch_size=2, warmup_steps=1)
    head = eagle.EagleHead(target, cfg, eagle_train.kept_vocabulary(rows, vocab, 96), rows[0][feature].shape[-1])
    torch.manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


@pytest.mark.parametrize("feature", ["final", "fused"])
def test_session_equals_batched_chain(tiny_rows, feature):
    """HeadSession (KV cache, one token at a time) drafts what chain() drafts from every start row."""
    target, rows = tiny_rows
    head, row = _head(target, rows, feature), rows[1]
    drafts = acceptance.eagle_drafts(head, row, 4)  # [4, n - 1]
    for t in (8, 15, 20):
        session = eagle.HeadSession(head)
        chain = [session.extend(row[feature][: t + 1], row["ids"][1 : t + 2])] + [session.draft_one() for _ in range(3)]
        assert chain == drafts[:, t].tolist()


def test_chain_is_causal(tiny_rows):
    """A draft from row t does not depend on anything after position t + 1."""
    target, rows = tiny_rows
    head, row = _head(target, rows, "final"), rows[3]
    cut = dict(row, ids=row["ids"][:20], final=row["final"][:19])
    assert torch.equal(acceptance.eagle_drafts(head, row, 3)[:, :19], acceptance.eagle_drafts(head, cut, 3))


def test_drafts_only_kept_ids(tiny_rows):
    """A pruned head proposes only ids of its kept vocabulary."""
    target, rows = tiny_rows
    head = _head(target, rows, "final", vocab=16)
    drafts = acceptance.eagle_drafts(head, rows[0], 3)
    assert set(drafts.flatten().tolist()) <= set(head.kept_ids.tolist())


def test_walk_counts_accepted_prefixes():
    """Greedy speculation along a known answer: accept the matching prefix, then skip past the target's token."""
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])  # prompt [0, 1], answer 2..7
    drafts = torch.full((2, 7), -1)
    drafts[:, 1] = torch.tensor([3, 4])  # from context ..x2: both right -> t moves to 4
    drafts[:, 4] = torch.tensor([6, 9])  # from context ..x5: one right -> t moves to 6 (no token left to draft)
    assert acceptance.walk(ids, 2, drafts, 2) == [(2, 2), (1, 2)]
    assert acceptance.summarize([(2, 2), (1, 2)], 2)["acceptance_by_position"] == [1.0, 0.5]
    assert acceptance.summarize([(2, 2), (0, 1)], 2)["acceptance_rate"] == round(2 / 3, 4)


def test_target_drafting_for_itself_is_always_accepted(tiny_rows):
    """The walk is exact: the target as its own drafter, along its own greedy answer, accepts everything."""
    target, rows = tiny_rows
    prompt = rows[0]["ids"][:8].long()
    with torch.no_grad():
        ids = target.generate(prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=0)[0]
    row = {"ids": ids, "prompt_len": 8}
    result = acceptance.acceptance(lambda r, s: acceptance.model_drafts(target, r, s), [row], ks=(1, 3, 4))
    assert [result[k]["acceptance_rate"] for k in ("k1", "k3", "k4")] == [1.0, 1.0, 1.0]


def test_training_lowers_the_loss(tiny_rows):
    """A few optimiser steps of chained training reduce the loss."""
    target, rows = tiny_rows
    cfg = eagle.EagleConfig(draft_vocab=48, batch_size=4, epochs=6, warmup_steps=1, lr=3e-3)
    head = eagle.EagleHead(target, cfg, eagle_train.kept_vocabulary(rows, 48, 96), 64)
    log = eagle_train.train(head, rows, cfg, top_k=8)
    assert log[-1]["loss"] < log[0]["loss"]


def test_session_grows_its_kv_mid_chain(tiny_rows):
    """A session that must grow its K/V while chaining drafts what a roomy one drafts (chain rows are kept)."""
    target, rows = tiny_rows
    head, row = _head(target, rows, "final"), rows[3]
    for t in (5, 6, 7, 13):
        chains = []
        for capacity in (t + 2, 256):
            session = eagle.HeadSession(head, capacity=capacity)
            chains.append([session.extend(row["final"][: t + 1], row["ids"][1 : t + 2])] + [session.draft_one() for _ in range(4)])
        assert chains[0] == chains[1]


@pytest.mark.parametrize("feature", ["final", "fused"])
def test_training_skips_rows_without_a_loss_exactly(tiny_rows, feature):
    """The training loss skips the output projection and MLP of the rows no step has a loss on (the prompt's):
    the loss and every gradient are those of the whole chain."""
    target, rows = tiny_rows
    batch = eagle_train.collate(rows, feature, 3, 8)
    assert not batch[-1][:, :4].any()  # (prompt rows without a loss exist)
    grads = []
    for skip in (True, False):
        torch.manual_seed(0)  # (the fused head's feature_in starts random)
        head = _head(target, rows, feature).train()
        if not skip:  # the whole chain: every row read
            chain = head.chain
            head.chain = lambda *a, rows=None, **k: chain(*a, **k)
        loss, parts = eagle_train.chain_loss(head, batch, 3, 0.1)
        loss.backward()
        grads.append((loss.detach(), parts, {n: p.grad.clone() for n, p in head.named_parameters()}))
    (loss_a, parts_a, grad_a), (loss_b, parts_b, grad_b) = grads
    assert torch.allclose(loss_a, loss_b, atol=1e-6) and parts_a == parts_b
    for name in grad_a:
        assert torch.allclose(grad_a[name], grad_b[name], atol=1e-6, rtol=1e-5), name
