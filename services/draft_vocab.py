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

Recipe (seeded, reproducible): the target answers the training prompts
greedily; ids are ranked by how often they occur in those answers, ties
(ids never seen) by id, which for a BPE vocabulary is merge order, a proxy
of corpus frequency. The ranking is shipped beside the drafter weights;
``N`` is a prefix of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import math

import torch

logger = logging.getLogger(__name__)

DRAFT_VOCAB_FILE = "draft_vocab.json"  # beside a drafter's weights; absent = full LM head
FULL_VOCAB = 0  # draft_vocab_size meaning "keep the whole LM head"
COVERAGE_SIZES = (4096, 8192, 12288, 16384)  # reported coverage of the target's answer tokens


@dataclass(frozen=True)
class DraftVocabRecipe:
    """How the ranking was made (stored in the file, so it can be re-made)."""

    seed: int = 0  # train_prompts shuffle
    num_prompts: int = 160  # training prompts answered by the target (18.7k answer tokens)
    max_new_tokens: int = 128  # per answer
    batch_size: int = 32  # prompts per batched generate
    max_size: int = 16384  # ids stored, most frequent first
    # N used when none is asked for: measured with `splitspec bench drafter --draft-vocab N`, acceptance
    # equal to the full head at every position for N >= 4096; 8192 covers 93.6% of held-out target tokens
    # (4096: 89.4%, a tighter cap on a better drafter) for 1.4 ms more per draft token than 4096
    default_size: int = 8192


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


def count_frequencies(answers: list[list[int]], vocab_size: int) -> torch.Tensor:  # [vocab_size] counts
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for answer in answers:
        counts += torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=vocab_size)
    return counts


def rank_ids(counts: torch.Tensor) -> torch.Tensor:  # [vocab_size] counts -> [vocab_size] ids
    """Most frequent first; equal counts by ascending id (BPE merge order)."""
    vocab_size = counts.shape[0]
    # one integer key: higher count first, then lower id (no reliance on a stable sort)
    key = counts.long() * vocab_size + (vocab_size - 1 - torch.arange(vocab_size))
    return torch.argsort(key, descending=True)


def coverage(counts: torch.Tensor, kept: torch.Tensor) -> float:
    """Fraction of the counted tokens that fall in ``kept`` (an upper bound on greedy acceptance)."""
    total = int(counts.sum())
    return int(counts[kept].sum()) / total if total else 0.0


@torch.inference_mode()
def generate_answers(target, tokenizer, prompts: list[str], *, max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """The target's greedy answers (ids after the chat prompt, up to and including EOS)."""
    from tqdm.auto import tqdm

    from services.models.distill import answer_length, chat_ids, left_padded, pad_and_eos

    pad, eos = pad_and_eos(target, tokenizer)
    encoded = [chat_ids(tokenizer, p) for p in prompts]  # in prompt order: the batches are part of the recipe
    answers = []
    for start in tqdm(range(0, len(encoded), batch_size), desc="target answers", unit="batch"):
        batch = encoded[start : start + batch_size]
        input_ids, attention = left_padded(batch, pad)
        width = input_ids.shape[1]
        out = target.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=pad)
        for row in out[:, width:].tolist():  # [B, T]
            answers.append(row[: answer_length(row, eos)])
    return answers


def build(target, tokenizer, recipe: DraftVocabRecipe = DraftVocabRecipe()) -> dict:
    """Run the recipe: the target answers the training prompts; rank ids by frequency."""
    from services.models.prompts import train_prompts

    torch.manual_seed(recipe.seed)
    prompts = train_prompts(recipe.seed)[: recipe.num_prompts]
    answers = generate_answers(target, tokenizer, prompts, max_new_tokens=recipe.max_new_tokens,
                               batch_size=recipe.batch_size)
    return rank_answers(answers, prompts, recipe, int(target.get_output_embeddings().weight.shape[0]))


def rank_answers(answers: list[list[int]], prompts: list[str], recipe: DraftVocabRecipe, vocab_size: int) -> dict:
    """The shipped report: recipe, data size, coverage of the kept prefixes, the ranked ids."""
    counts = count_frequencies(answers, vocab_size)
    ranked = rank_ids(counts)[: recipe.max_size]
    report = {
        "recipe": asdict(recipe),
        "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16],
        "prompts": len(prompts),
        "answer_tokens": int(counts.sum()),
        "distinct_ids": int((counts > 0).sum()),
        "train_coverage": {str(n): round(coverage(counts, ranked[:n]), 4) for n in COVERAGE_SIZES if n <= recipe.max_size},
        "default_size": recipe.default_size,
        "ranked_ids": ranked.tolist(),
    }
    logger.info("draft vocabulary: %d answer tokens, %d distinct ids, coverage %s",
                report["answer_tokens"], report["distinct_ids"], report["train_coverage"])
    return report


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
