"""`splitspec drafter train` end to end (a subprocess starting a local Ray cluster of its own; in the in-process
part of the suite, beside the other worker's tests) on a tiny random pair around the default tokenizer: the data on Ray
actors, both variants trained with Ray Train, the report per Spec-Bench category, the head installed beside the
drafter and loaded as serve loads it (and refused for another target); a resumed run keeps the units it has and
only adds what the larger budget needs; a prompt file that copies Spec-Bench is refused before anything starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services import eagle_draft
from services.loading import load_head_parts
from services.models import default_pair, specbench
from services.models.tiny import random_pair
from services.training import pipeline

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--unit-prompts", "8", "--unit-followups", "4", "--max-new-tokens", "24", "--self-instruct", "0",
         "--eval-prompts", "6", "--eval-held-out", "2", "--eval-max-new-tokens", "24", "--draft-vocab", "512",
         "--train-workers", "2"]


def train(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "splitspec.cli", "drafter", "train", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair"), default_pair.target_dir(), "small")


def test_train_install_and_resume(pair, tmp_path):
    target, draft = pair
    mine = tmp_path / "mine.jsonl"
    mine.write_text("\n".join(json.dumps(x) for x in (
        {"prompt": "Write a SQL query that counts the orders per customer."},
        {"messages": [{"role": "user", "content": "Rename the variable x to total in my script."},
                      {"role": "assistant", "content": "Sure."}]},
    )) + "\n")
    out = tmp_path / "run"
    done = train("--target", target, "--out", out, "--tokens", 600, "--prompts", mine, "--install", draft, *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["answer_tokens"] >= 600 and set(report["variants"]) == {"final", "fused"}
    assert report["installed_variant"] == "final"  # (serving reads the final-norm features)
    sets = set(report["variants"]["final"]["acceptance"])
    assert {"held_out", "specbench"} <= sets and len([s for s in sets if s.startswith("specbench/")]) == 6
    k3 = report["variants"]["final"]["acceptance"]["specbench"]["k3"]
    assert len(k3["acceptance_by_position"]) == 3 and k3["mean_accepted_length"] >= 1.0
    prompts = json.loads((out / "data" / "prompts.json").read_text())
    assert sum(kind == "user" for kind, _ in prompts) == 2
    units = {p.name: p.stat().st_mtime_ns for p in pipeline.unit_paths(out / "data")}
    # installed where serve looks (the drafter folder), and refused for another target
    installed = eagle_draft.find(draft)
    assert installed is not None
    head = eagle_draft.load(installed, load_head_parts(target))
    assert head.cfg.feature == "final" and len(head.kept_ids) == 512
    with pytest.raises(ValueError, match="trained for target"):
        eagle_draft.load(installed, load_head_parts(default_pair.target_dir()))
    # an existing run is not overwritten; --resume with a larger budget keeps every unit and adds some; --init goes on
    # training the first head on the units it has not seen (a run in stages), and refuses another target's head
    again = train("--target", target, "--out", out, "--tokens", 600, *SMALL)
    assert again.returncode != 0 and "--resume" in again.stderr
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(b"")
    (tmp_path / pipeline.REPORT_FILE).write_text(json.dumps({"target": "another", "units": 1, "answer_tokens": 1}))
    refused = train("--target", target, "--out", tmp_path / "other", "--init", foreign, *SMALL, timeout=120)
    assert refused.returncode != 0 and "another target" in refused.stderr and not (tmp_path / "other").exists()
    first = out / "first-head"
    (out / "head").rename(first)
    more = train("--target", target, "--out", out, "--tokens", 1200, "--prompts", mine, "--resume", *SMALL,
                 "--variants", "final", "--init", first)  # (the same data recipe; --init goes on with its variant)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    after = {p.name: p.stat().st_mtime_ns for p in pipeline.unit_paths(out / "data")}
    assert len(after) > len(units) and all(after[name] == mtime for name, mtime in units.items())
    staged = json.loads((out / "report.json").read_text())
    assert staged["answer_tokens"] >= 1200 and report["units"] < staged["units"] <= len(after)
    assert [s["units"] for s in staged["stages"]] == [report["units"], staged["units"] - report["units"]]
    went_on = eagle_draft.load(out / "head" / pipeline.HEAD_FILE, load_head_parts(target))
    assert went_on.kept_ids.equal(head.kept_ids)  # the first head's, not a new head's (from the new units' ids)


def test_a_prompt_file_that_copies_spec_bench_is_refused(pair, tmp_path):
    target, _ = pair
    copied = tmp_path / "copied.jsonl"
    question = specbench.questions()[100]
    copied.write_text(json.dumps({"prompt": "Hi! " + question.first_turn}) + "\n")
    refused = train("--target", target, "--out", tmp_path / "run", "--prompts", copied, *SMALL, timeout=120)
    assert refused.returncode != 0
    assert f"Spec-Bench question {question.question_id}" in refused.stderr
    assert not (tmp_path / "run").exists()


def test_a_data_folder_of_another_recipe_is_refused(pair, tmp_path):
    """Units resume only with the recipe they were made with (their recipe.json): another is refused up front."""
    target, _ = pair
    data = tmp_path / "data"
    pipeline.open_data(pipeline.TrainJob(target=str(target), max_new_tokens=24), data)
    refused = train("--target", target, "--data", data, "--out", tmp_path / "run", "--max-new-tokens", 32, timeout=120)
    assert refused.returncode != 0 and "another recipe" in refused.stderr and "max_new_tokens" in refused.stderr
    assert not (tmp_path / "run").exists()
