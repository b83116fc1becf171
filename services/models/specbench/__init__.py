"""Spec-Bench's questions (SOURCE.md): the public yardstick the drafter and the service are measured on, never
trained on.

Six categories of 80 first turns: ``mt_bench`` (MT-Bench's eight categories of ten), ``translation``,
``summarization``, ``qa``, ``math_reasoning`` and ``rag``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

QUESTIONS = Path(__file__).with_name("question.jsonl")
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str  # one of CATEGORIES
    subcategory: str  # MT-Bench's own category; the category elsewhere
    turns: tuple[str, ...]

    @property
    def first_turn(self) -> str:
        return self.turns[0]


@cache
def questions() -> tuple[Question, ...]:
    """All 480, in the file's order."""
    rows = [json.loads(line) for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return tuple(Question(r["question_id"], "mt_bench" if r["category"] in MT_BENCH else r["category"], r["category"],
                          tuple(r["turns"])) for r in rows)


def interleaved(seed: int = 0) -> list[Question]:
    """All 480, shuffled within each category (``seed``) and dealt round-robin over the categories: any first n are a
    sample spread evenly over the six (what a subset run takes)."""
    rng = random.Random(seed)
    by_category = {c: [q for q in questions() if q.category == c] for c in CATEGORIES}
    for qs in by_category.values():
        rng.shuffle(qs)
    return [q for round_ in zip(*by_category.values(), strict=True) for q in round_]
