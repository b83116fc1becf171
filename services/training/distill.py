"""Derive a drafter from the target: truncate to its first layers, then distil.

Recipe (seeded, reproducible):
1. the target answers instruction / code prompts greedily (batched ``generate``);
2. one teacher-forced target pass records its top-K next-token log-probs at
   every response position;
3. the student — the target's first ``num_layers`` decoder layers, its final
   norm and its (tied, frozen) embeddings / LM head — is trained to minimise
   cross-entropy to the renormalised teacher top-K (forward KL up to a constant).
Generated data is cached, so changing the training recipe does not regenerate it.
``retrain_drafter`` runs it for the default pair and installs the drafter
(``splitspec models prepare --retrain``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

from services import draft_vocab
from services.models import default_pair
from services.models.default_pair import trainable_state, truncated_student
from services.models.prompts import held_out_prompts
from services.text import chat_ids
from services.training import selfinstruct, vocab
from services.training.answers import answer_length, left_padded, pad_and_eos
from services.training.prompts import train_prompts

logger = logging.getLogger(__name__)
HELD_OUT_TOKENS = 64  # answer length of held-out evaluation sequences
TEMPLATE_DATA = "templates"
SELFINSTRUCT_DATA = "selfinstruct"


@dataclass(frozen=True)
class DistillConfig:
    num_layers: int = 4  # decoder layers kept from the target
    seed: int = 0
    num_prompts: int = 288  # training prompts answered by the target
    max_new_tokens: int = 128  # per answer
    gen_batch_size: int = 48
    teacher_top_k: int = 32  # teacher log-probs kept per position
    epochs: int = 6
    batch_size: int = 8  # sequences per optimiser step
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    num_threads: int = 2
    data: str = TEMPLATE_DATA  # TEMPLATE_DATA (prompts.train_prompts) or SELFINSTRUCT_DATA (selfinstruct shards)
    max_shards: int | None = None  # with SELFINSTRUCT_DATA: train on the first shards only (data-size curve)
    init: str = "target"  # "target": the target's first layers; "shipped": continue from the shipped drafter

    def data_key(self) -> str:
        fields = (self.seed, self.num_prompts, self.max_new_tokens, self.teacher_top_k)
        if self.data != TEMPLATE_DATA:  # the template recipe keeps its cache key
            fields += (self.data, self.max_shards)
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:12]


@torch.inference_mode()
def generate_teacher_data(target, tokenizer, cfg: DistillConfig, prompts: list[str] | None = None) -> dict:
    """Greedy target answers plus the target's top-K log-probs at each answer position.

    The log-probs come from the logits ``generate`` already computed, so the
    teacher costs no extra forward pass.
    """
    prompts = prompts or train_prompts(cfg.seed)[: cfg.num_prompts]
    pad, eos = pad_and_eos(target, tokenizer)
    data = {"sequences": [], "masks": [], "top_idx": [], "top_logp": []}
    for start in tqdm(range(0, len(prompts), cfg.gen_batch_size), desc="target answers", unit="batch"):
        batch = [chat_ids(tokenizer, p) for p in prompts[start : start + cfg.gen_batch_size]]
        input_ids, attention = left_padded(batch, pad)
        width = input_ids.shape[1]
        out = target.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=cfg.max_new_tokens,
            do_sample=False, pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
        )
        answers = out.sequences[:, width:]  # [B, T]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, vocab_size]
        values, indices = torch.topk(torch.log_softmax(logits, dim=-1), cfg.teacher_top_k, dim=-1)  # [B, T, K]
        for b, prompt in enumerate(batch):
            answer = answers[b].tolist()
            end = answer_length(answer, eos)
            mask = torch.zeros(len(prompt) + end, dtype=torch.bool)
            mask[len(prompt) - 1 : len(prompt) - 1 + end] = True  # positions that predict an answer token
            data["sequences"].append(torch.tensor(prompt + answer[:end]))
            data["masks"].append(mask)
            data["top_idx"].append(indices[b, :end].int())
            data["top_logp"].append(values[b, :end].half())
    return data


def _batches(data: dict, batch_size: int, generator: torch.Generator):
    order = torch.randperm(len(data["sequences"]), generator=generator).tolist()
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def _collate(data: dict, index: list[int], pad: int):
    width = max(len(data["sequences"][i]) for i in index)
    B, K = len(index), data["top_idx"][index[0]].shape[-1]
    input_ids = torch.full((B, width), pad, dtype=torch.long)  # [B, L] right padded
    attention = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.bool)
    top_idx = torch.zeros((B, width, K), dtype=torch.long)
    top_logp = torch.zeros((B, width, K))
    for row, i in enumerate(index):
        n = len(data["sequences"][i])
        input_ids[row, :n] = data["sequences"][i]
        attention[row, :n] = 1
        mask[row, :n] = data["masks"][i]
        top_idx[row, :n][data["masks"][i]] = data["top_idx"][i].long()
        top_logp[row, :n][data["masks"][i]] = data["top_logp"][i].float()
    return input_ids, attention, mask, top_idx, top_logp


def distil(student, data: dict, cfg: DistillConfig, pad: int, held_out: dict | None = None, *,
           callback=None, callback_every: int = 0) -> list[float]:
    """Train the student's layers and norm to match the teacher's top-K distributions.

    ``callback(step, student)`` runs every ``callback_every`` steps (in eval mode), e.g. for a learning curve.
    """
    student.train()
    student.model.embed_tokens.requires_grad_(False)
    params = [p for n, p in student.named_parameters() if n.startswith("model.layers.") or n == "model.norm.weight"]
    for p in params:
        p.requires_grad_(True)
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(data["sequences"]) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    losses = []
    bar = tqdm(total=total, desc="distil drafter", unit="step")
    for _ in range(cfg.epochs):
        for index in _batches(data, cfg.batch_size, generator):
            input_ids, attention, mask, top_idx, top_logp = _collate(data, index, pad)
            hidden = student.model(input_ids=input_ids, attention_mask=attention).last_hidden_state  # [B, L, hidden]
            logits = student.lm_head(hidden[mask])  # [N, vocab_size], answer positions only
            logq = torch.log_softmax(logits.float(), dim=-1)
            teacher = torch.softmax(top_logp[mask], dim=-1)  # [N, K] renormalised top-K
            loss = -(teacher * logq.gather(-1, top_idx[mask])).sum(-1).mean()
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            schedule.step()
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            if callback is not None and callback_every and len(losses) % callback_every == 0:
                student.eval()
                callback(len(losses), student)
                student.train()
        if held_out is not None:
            student.eval()
            logger.info("epoch done: loss %.3f, held-out greedy agreement %.3f", losses[-1], greedy_agreement(student, held_out))
            student.train()
    bar.close()
    student.eval()
    student.requires_grad_(False)
    return losses


@torch.inference_mode()
def held_out_data(target, tokenizer, cfg: DistillConfig) -> dict:
    """The target's greedy answers to the held-out prompts (for measuring agreement)."""
    held = DistillConfig(**{**asdict(cfg), "num_prompts": len(held_out_prompts()), "max_new_tokens": HELD_OUT_TOKENS})
    return generate_teacher_data(target, tokenizer, held, prompts=held_out_prompts())


@torch.inference_mode()
def greedy_agreement(student, held_out: dict) -> float:
    """Fraction of answer positions where the student's argmax is the target's greedy next token."""
    hits = total = 0
    for seq, mask in zip(held_out["sequences"], held_out["masks"]):
        predicted = student(input_ids=seq[None]).logits[0].argmax(-1)  # [L]
        positions = mask[:-1].nonzero().squeeze(-1)  # predicting positions with a next token in seq
        hits += int((predicted[positions] == seq[positions + 1]).sum())
        total += positions.numel()
    return hits / max(total, 1)


def shipped_state() -> dict[str, torch.Tensor]:
    """The shipped drafter's trained layers and norm (float32)."""
    return {k: v.float() for k, v in load_file(default_pair.SHIPPED_DRAFTER).items()}


def _cached(path: Path, make):
    if path.is_file():
        return torch.load(path)
    value = make()
    torch.save(value, path)
    return value


def run(target, tokenizer, cfg: DistillConfig, cache_dir: Path) -> tuple[LlamaForCausalLM, dict]:
    """Full recipe; returns the trained student and a report."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.num_threads)
    cache_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if cfg.data == SELFINSTRUCT_DATA:  # generated (and cached) by selfinstruct.build; never regenerated here
        rows = selfinstruct.load(cache_dir.parent / "selfinstruct", selfinstruct.DataConfig(), max_shards=cfg.max_shards)["rows"]
        if not rows:
            raise FileNotFoundError("no self-instruct shards: run selfinstruct.build first")
        data = selfinstruct.to_distill_data(rows)
    else:
        data = _cached(cache_dir / f"teacher-data-{cfg.data_key()}.pt", lambda: generate_teacher_data(target, tokenizer, cfg))
    held_out = _cached(cache_dir / f"held-out-{cfg.data_key()}.pt", lambda: held_out_data(target, tokenizer, cfg))
    t_data = time.time() - t0
    student = truncated_student(target, cfg.num_layers)
    if cfg.init == "shipped":
        student.load_state_dict(shipped_state(), strict=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    before = greedy_agreement(student, held_out)
    losses = distil(student, data, cfg, pad, held_out)
    t_train = time.time() - t0 - t_data
    report = {
        "config": asdict(cfg),
        "answer_tokens": int(sum(m.sum() for m in data["masks"])),
        "data_seconds": round(t_data, 1),
        "train_seconds": round(t_train, 1),
        "final_loss": round(sum(losses[-20:]) / max(len(losses[-20:]), 1), 4),
        "held_out_greedy_agreement_before": round(before, 4),
        "held_out_greedy_agreement": round(greedy_agreement(student, held_out), 4),
    }
    logger.info("drafter distilled: %s", report)
    return student, report


def retrain_drafter(*, config: DistillConfig | None = None, export: bool = False) -> Path:
    """Distil the default drafter anew and install it (``splitspec models prepare --retrain``, about 30 minutes).

    Without ``export`` the drafter folder is marked retrained, so later ``prepare`` runs keep it. With ``export``
    the shipped draft vocabulary, weights (bf16) and report are re-made, and the drafter installed is the one built
    from the shipped weights, as everyone's is.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tpath = default_pair.prepare_target()
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tpath)
    if export:  # the ranking depends on the target only; re-made with the shipped weights
        default_pair.SHIPPED_WEIGHTS.mkdir(exist_ok=True)
        draft_vocab.save(vocab.build(target, tokenizer), default_pair.SHIPPED_DRAFT_VOCAB)
    config = config or DistillConfig()
    student, report = run(target, tokenizer, config, default_pair.home() / "distill")
    if not export:
        report["source"] = "retrained"  # kept by later `prepare` runs; --export ships it
        return default_pair.install_drafter(student, tokenizer, report)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in trainable_state(student).items()}
    save_file(state, default_pair.SHIPPED_DRAFTER, metadata={"num_layers": str(config.num_layers)})
    default_pair.SHIPPED_REPORT.write_text(json.dumps(report, indent=2) + "\n")
    report = json.loads(default_pair.SHIPPED_REPORT.read_text())
    return default_pair.install_drafter(default_pair.shipped_drafter(target, config.num_layers), tokenizer, report)
