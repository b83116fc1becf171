"""The trainer refuses a prompt file with any 8-gram of a Spec-Bench or MT-Bench turn (issue 39)."""

import pytest

from services.models import specbench
from services.training import contamination
from services.training.contamination import ContaminatedPromptError


def test_a_spec_bench_turn_is_refused_even_reworded_around_it():
    for q in (specbench.questions()[0], specbench.questions()[-1]):  # MT-Bench's first, and RAG's last
        words = q.turns[0].split()[:12]
        copied = "Please help: " + " ".join(words).upper().replace(",", " ,") + " thanks!"
        with pytest.raises(ContaminatedPromptError, match=f"question {q.question_id}"):
            contamination.check(["Name three primary colors.", copied], "prompts.jsonl")


def test_mt_bench_second_turns_count_too():
    q = next(q for q in specbench.questions() if q.category == "mt_bench" and len(q.turns) > 1)
    assert contamination.contaminated(q.turns[1]) is not None


def test_ordinary_prompts_pass():
    contamination.check(["What is the capital of France?", "Write a haiku about autumn leaves in the park.",
                         "Summarize the following text in one sentence: the cat sat on the mat all day long."], "bank")


def test_short_overlap_is_not_contamination():
    words = specbench.questions()[0].turns[0].split()
    assert contamination.contaminated(" ".join(words[:7])) is None
