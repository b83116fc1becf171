"""Greedy acceptance measured offline, along the target's own greedy answers (no serving loop).

For each answer, every drafter's chain of up to k tokens is compared with the tokens the target wrote next;
``walk`` replays speculative decoding over them (accept the matching prefix, then the target's own token).
``eagle_recipe`` and ``drafter_curve`` report it by draft position.
"""

from __future__ import annotations


import torch

from services.models.eagle import EagleHead
from services.training.eagle_train import feature_of


def walk(ids: torch.Tensor, prompt_len: int, drafts: torch.Tensor, k: int) -> list[int]:
    """Greedy speculative decoding along the target's own greedy answer ``ids``.

    drafts: [S, n] with drafts[s, t] the (s+1)-th draft token from a context
    ending at x_{t+1} (it guesses x_{t+s+2}). Starts after prefill (context =
    prompt + first answer token), drafts k, accepts the matching prefix, moves
    past the accepted tokens and the target's own token. Returns (accepted,
    drafted) per step; near the end of the answer fewer than k are drafted,
    as the loop does.
    """
    n, t, accepted = len(ids), prompt_len - 1, []
    while t + 2 <= n - 1:
        kk = min(k, n - 2 - t)
        m = 0
        while m < kk and int(drafts[m, t]) == int(ids[t + m + 2]):
            m += 1
        accepted.append((m, kk))
        t += m + 1
    return accepted


def summarize(per_step: list[tuple[int, int]], k: int) -> dict:
    """Accepted / drafted, acceptance at each draft position, tokens per verify step (incl. the target's)."""
    steps = len(per_step)
    accepted, drafted = sum(m for m, _ in per_step), sum(kk for _, kk in per_step)
    by_pos = [sum(m > j for m, _ in per_step) / max(sum(kk > j for _, kk in per_step), 1) for j in range(k)]
    return {
        "k": k, "steps": steps, "acceptance_rate": round(accepted / max(drafted, 1), 4),
        "acceptance_by_position": [round(x, 4) for x in by_pos],
        "mean_accepted_length": round(1 + accepted / max(steps, 1), 4),
    }


@torch.inference_mode()
def eagle_drafts(head: EagleHead, row: dict, steps: int) -> torch.Tensor:  # -> [steps, n - 1] token ids
    n = len(row["ids"])
    feats = feature_of(row, head.cfg.feature).float()[None]  # [1, n - 1, F]
    tokens = torch.zeros(1, n - 1 + steps, dtype=torch.long)
    tokens[0, : n - 1] = row["ids"][1:].long()
    return torch.cat(head.chain(feats, tokens, steps, teacher_tokens=False)[1])


@torch.inference_mode()
def model_drafts(drafter, row: dict, steps: int, kept_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A token-only drafter's greedy chain equals its teacher-forced argmax while it keeps matching."""
    logits = drafter(input_ids=row["ids"].long()[None]).logits[0]  # [n, vocab_size]
    if kept_ids is not None:
        pred = kept_ids[logits[:, kept_ids].argmax(-1)]
    else:
        pred = logits.argmax(-1)  # pred[j] guesses x_{j+1}
    n = len(row["ids"])
    drafts = torch.full((steps, n - 1), -1, dtype=torch.long)
    for s in range(steps):  # step s from context ending at x_{t+1} guesses x_{t+s+2} = pred[t+s+1]
        drafts[s, : n - 2 - s] = pred[s + 1 : n - 1]
    return drafts


def acceptance(drafts_fn, rows: list[dict], ks=(1, 2, 3, 4)) -> dict:
    """Acceptance by position for each k, over ``rows`` (greedy; chains of up to max(ks))."""
    per_k = {k: [] for k in ks}
    for r in rows:
        drafts = drafts_fn(r, max(ks))
        for k in ks:
            per_k[k] += walk(r["ids"], r["prompt_len"], drafts, k)
    return {f"k{k}": summarize(v, k) for k, v in per_k.items()}
