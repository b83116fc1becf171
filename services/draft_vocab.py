"""Pruned draft vocabulary (FR-Spec: Zhao et al., arXiv 2502.14856).

A small drafter spends about half of each draft token in its LM head (one row
per vocabulary id: 49152 rows for SmolLM2). The target's answers use a small
part of that vocabulary, so the drafter's head keeps only the ``N`` ids the
target itself emits most often.

Exactness does not depend on it: the draft distribution q stays a
distribution over the *full* vocabulary, zero outside the kept ids (the
runners return -inf logits there). The rejection sampler then accepts a draft
token x with probability min(1, p(x) / q(x)) and recovers from
norm(max(p - q, 0)), which puts the target's mass on the ids the drafter
cannot propose; greedy drafting takes the argmax over the kept ids.

The ranking (the target's ids by how often it emits them: the recipe is
services.training.vocab) is shipped beside the drafter weights; ``N`` is a
prefix of it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import math

import torch

logger = logging.getLogger(__name__)

DRAFT_VOCAB_FILE = "draft_vocab.json"  # beside a drafter's weights; absent = full LM head
FULL_VOCAB = 0  # draft_vocab_size meaning "keep the whole LM head"


@dataclass(frozen=True)
class DraftVocab:
    """The target's token ids ranked by frequency in its own answers (most frequent first)."""

    ranked_ids: tuple[int, ...]  # [max_size]
    default_size: int

    def kept_ids(self, size: int | None = None) -> torch.Tensor:  # [N] ascending ids; None = default size
        size = self.default_size if size is None else size
        if not 0 < size <= len(self.ranked_ids):
            raise ValueError(f"draft vocabulary size must be in [1, {len(self.ranked_ids)}], got {size}")
        return torch.tensor(sorted(self.ranked_ids[:size]), dtype=torch.long)


def save(report: dict, path: Path) -> None:
    """One JSON file: the metadata on top, then the ranked ids on one line."""
    meta = {k: v for k, v in report.items() if k != "ranked_ids"}
    text = json.dumps(meta, indent=2)[:-2] + ',\n  "ranked_ids": ' + json.dumps(report["ranked_ids"], separators=(",", ":")) + "\n}\n"
    path.write_text(text)


def load(path: Path) -> DraftVocab:
    data = json.loads(Path(path).read_text())
    return DraftVocab(tuple(data["ranked_ids"]), int(data["default_size"]))


def find(model) -> DraftVocab | None:
    """The ranking shipped in a drafter's folder (``model.name_or_path``), or None: keep the full head."""
    folder = getattr(model, "name_or_path", "") or ""
    path = Path(folder) / DRAFT_VOCAB_FILE if folder else None
    if path is None or not path.is_file():
        return None
    vocab = load(path)
    logger.info("draft vocabulary from %s: %d ranked ids, default size %d", path, len(vocab.ranked_ids), vocab.default_size)
    return vocab


def resolve_kept_ids(vocab: DraftVocab | None, size: int | None, vocab_size: int) -> torch.Tensor | None:
    """Kept ids [N] for a requested size (None = the vocabulary's default, FULL_VOCAB = all); None = full head."""
    if size == FULL_VOCAB or (vocab is None and size is None):
        return None
    if vocab is None:
        raise ValueError(f"draft vocabulary size {size} asked for, but the drafter has no {DRAFT_VOCAB_FILE}")
    if size is not None and size >= vocab_size:
        return None
    kept = vocab.kept_ids(size)
    if int(kept.max()) >= vocab_size:
        raise ValueError(f"the draft vocabulary has ids outside the model's vocabulary of {vocab_size}")
    return kept


def scatter_kept(
    logits: torch.Tensor,  # [m, N] logits of the kept ids
    kept_ids: torch.Tensor,  # [N]
    vocab_size: int,
) -> torch.Tensor:  # [m, vocab_size], -inf outside the kept ids (probability zero after softmax)
    full = logits.new_full((logits.shape[0], vocab_size), -math.inf)
    return full.index_copy_(1, kept_ids, logits)
