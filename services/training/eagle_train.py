"""Training an EAGLE head (services.models.eagle) on the target's own answers and features.

The data are self-instruct rows (services.training.selfinstruct: ids, the target's features, its top-K
log-probs at each answer position). The loss, per chained draft step (EAGLE-3's "training-time test"): soft
cross-entropy to the target's top-K renormalised over the head's kept ids, plus smooth-L1 from the head's
output to the target's next feature. ``eagle_recipe`` runs it and ships the head.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from services.models.eagle import NO_ID, EagleConfig, EagleHead

logger = logging.getLogger(__name__)

CHECKPOINT_EVERY = 25  # optimiser steps between progress logs / checkpoints


def kept_vocabulary(rows: Iterable[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` ids the target emits most often in ``rows`` (ties by id), sorted; ``rows`` is read once (a
    stream over data files does)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r["ids"][r["prompt_len"]:].long(), minlength=vocab_size)
    if not size or size >= vocab_size:
        return torch.arange(vocab_size)
    return torch.sort(torch.topk(counts, size, sorted=True).indices).values


def feature_of(row: dict, feature: str) -> torch.Tensor:  # [n - 1, feature_dim]
    return row[feature]


def collate(rows: list[dict], feature: str, steps: int, top_k: int):
    """Right-padded batch for ``chain`` and the loss targets.

    Returns features [B, L, F], tokens [B, L + steps], teacher ids / log-probs
    [B, L + steps, K] at each *position* (the target's distribution for the
    next token), next features [B, L + steps, h] and a mask of positions with a
    teacher (answer positions).
    """
    L = max(len(r["ids"]) - 1 for r in rows)
    B = len(rows)
    fdim, h = feature_of(rows[0], feature).shape[-1], rows[0]["final"].shape[-1]
    feats = torch.zeros(B, L, fdim)
    tokens = torch.zeros(B, L + steps, dtype=torch.long)
    t_idx = torch.zeros(B, L + steps, top_k, dtype=torch.long)
    t_logp = torch.full((B, L + steps, top_k), -math.inf)
    final = torch.zeros(B, L + steps, h)
    has_teacher = torch.zeros(B, L + steps, dtype=torch.bool)
    for b, r in enumerate(rows):
        n, p = len(r["ids"]), r["prompt_len"]
        feats[b, : n - 1] = feature_of(r, feature).float()
        tokens[b, : n - 1] = r["ids"][1:].long()
        final[b, : n - 1] = r["final"].float()
        t_idx[b, p - 1 : n - 1] = r["top_idx"][: n - p].long()
        t_logp[b, p - 1 : n - 1] = r["top_logp"][: n - p].float()
        has_teacher[b, p - 1 : n - 1] = True
    return feats, tokens, t_idx, t_logp, final, has_teacher


def chain_loss(head: EagleHead, batch, steps: int, reg_weight: float):
    """Mean over steps of soft CE to the target's top-K (kept ids) + smooth-L1 to the next feature."""
    feats, tokens, t_idx, t_logp, final, has_teacher = batch
    L = feats.shape[1]
    total, parts = 0.0, []
    read = torch.stack([has_teacher[:, s + 1 : s + 1 + L] for s in range(steps)]).any(0)  # [B, L] rows with a loss
    for s, h_out in enumerate(head.chain(feats, tokens, steps, teacher_tokens=True, rows=read)[0]):
        pos = slice(s + 1, s + 1 + L)  # row t at step s drafts the token the target predicts at position t+s+1
        mask = has_teacher[:, pos]
        idx, logp = head.remap[t_idx[:, pos][mask]], t_logp[:, pos][mask]  # [M, K]
        logp = logp.masked_fill(idx == NO_ID, -math.inf)
        weight = torch.softmax(logp, dim=-1).nan_to_num(0.0)  # teacher renormalised over the kept ids
        logq = torch.log_softmax(head.logits(h_out[mask]), dim=-1)  # [M, N], answer positions only
        ce = -(weight * logq.gather(-1, idx.clamp(min=0))).sum(-1).mean()
        reg = F.smooth_l1_loss(head.norm_out(h_out[mask]), final[:, pos][mask])
        total = total + ce + reg_weight * reg
        parts.append(round(ce.item(), 3))
    return total / steps, parts


def train(head: EagleHead, rows: list[dict], cfg: EagleConfig, top_k: int, *, max_seconds: float | None = None,
          checkpoint=None) -> list[dict]:
    """Train on ``rows`` in memory (``train_batches`` over batches of similar length). Returns the loss log."""
    by_length = sorted(range(len(rows)), key=lambda i: len(rows[i]["ids"]))  # batches of similar length pad less
    batches = [[rows[i] for i in by_length[j : j + cfg.batch_size]] for j in range(0, len(by_length), cfg.batch_size)]

    def epoch(generator: torch.Generator):
        return (batches[b] for b in torch.randperm(len(batches), generator=generator).tolist())

    return train_batches(head, epoch, len(batches), cfg, top_k, max_seconds=max_seconds, checkpoint=checkpoint)


def train_batches(head: EagleHead, epoch, batches_per_epoch: int, cfg: EagleConfig, top_k: int, *,
                  max_seconds: float | None = None, checkpoint=None, sync_gradients=None, agree=None) -> list[dict]:
    """AdamW, warmup then cosine to zero over ``cfg.epochs`` or ``max_seconds``, whichever ends first.

    ``epoch(generator)`` yields one epoch's batches (lists of rows) in a seeded order: from memory, or streamed from
    data files one at a time. With a time budget the cosine follows max(step fraction, time fraction), so a run cut
    by the clock still ends annealed. ``checkpoint(step)`` runs every ``CHECKPOINT_EVERY`` steps;
    ``sync_gradients(params)`` (data-parallel workers: an all-reduce) runs between backward and the step. Returns
    the loss log. ``agree(progress)``: the progress every worker goes by (their largest), so that data-parallel
    workers on a time budget stop at the same step.
    """
    params = [p for p in head.parameters() if p.requires_grad]
    device = params[0].device  # (batches are collated on the CPU and moved to the head's device)
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed)
    total = batches_per_epoch * cfg.epochs
    log, start, step = [], time.perf_counter(), 0
    bar = tqdm(total=total, desc=f"eagle head ({cfg.feature})", unit="step")
    for _ in range(cfg.epochs):
        for rows in epoch(generator):
            progress = step / total
            if max_seconds:
                progress = max(progress, (time.perf_counter() - start) / max_seconds)
                if agree is not None:
                    progress = agree(progress)
            if progress >= 1.0:
                break
            for group in optim.param_groups:
                group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress))
            batch = tuple(t.to(device) for t in collate(rows, cfg.feature, cfg.ttt_steps, top_k))
            loss, parts = chain_loss(head, batch, cfg.ttt_steps, cfg.reg_weight)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            if sync_gradients is not None:
                sync_gradients(params)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            step += 1
            log.append({"step": step, "loss": round(loss.item(), 4), "ce_by_step": parts,
                        "seconds": round(time.perf_counter() - start, 1)})
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", ce=parts)
            if step % CHECKPOINT_EVERY == 0:
                recent = log[-CHECKPOINT_EVERY:]
                logger.info("step %d/%d mean loss %.3f, last ce by step %s (%.0f s)", step, total,
                            sum(x["loss"] for x in recent) / len(recent), parts, time.perf_counter() - start)
                if checkpoint is not None:
                    checkpoint(step)
    bar.close()
    return log
