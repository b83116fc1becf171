"""The drafter is measured on Spec-Bench and never trained on it: a training prompt that shares any 8-gram of words
with a turn of Spec-Bench (which holds MT-Bench's 80 questions, both turns) is refused.

Words are lower-cased runs of letters and digits, so punctuation, case and spacing do not hide a copy. Eight words
is the usual contamination window: long enough that ordinary phrases ("what is the capital of") do not match, short
enough that a paraphrased copy of a question does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache

from services.models import specbench

N = 8  # words per n-gram
WORD = re.compile(r"[^\W_]+", re.UNICODE)


class ContaminatedPromptError(ValueError):
    """A training prompt shares an 8-gram with the yardstick."""


def ngrams(text: str, n: int = N) -> set[tuple[str, ...]]:
    words = WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@cache
def yardstick() -> dict[tuple[str, ...], int]:
    """Every 8-gram of every Spec-Bench turn -> the question it comes from."""
    return {gram: q.question_id for q in specbench.questions() for turn in q.turns for gram in ngrams(turn)}


def contaminated(text: str) -> tuple[tuple[str, ...], int] | None:
    """The first 8-gram ``text`` shares with the yardstick and its question id, or None."""
    grams = yardstick()
    return next(((gram, grams[gram]) for gram in ngrams(text) if gram in grams), None)


def check(prompts: Iterable[str], source: str) -> None:
    """Refuse ``prompts`` (from ``source``, named in the error) if any shares an 8-gram with Spec-Bench or MT-Bench."""
    for i, text in enumerate(prompts):
        if (hit := contaminated(text)) is not None:
            gram, question = hit
            raise ContaminatedPromptError(
                f"{source}: prompt {i + 1} shares the 8 words {' '.join(gram)!r} with Spec-Bench question {question} "
                "(the benchmark the drafter is measured on, never trained on): remove it")
