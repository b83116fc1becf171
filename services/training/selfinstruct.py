"""Distillation data from the target itself: broad prompts, greedy answers, features.

Recipe (seeded, cached under ``$SPLITSPEC_HOME/selfinstruct`` keyed by the recipe):
1. **self-instruct**: the target writes user requests for itself from
   one-line meta-prompts per domain, sampled at ``instruct_temperature``;
   requests that name a held-out subject are dropped;
2. **answers**: the target answers the crossed-template prompts of
   ``prompt_bank`` and the self-instructed ones greedily, in large batches;
3. **follow-ups**: summaries and rewrites of its own answers, and second turns
   of a chat (the first answer in context), answered greedily too.
While generating, hooks record what drafters learn from, at no extra pass:
the final-norm output (EAGLE's feature), the residual stream after a low, a
mid and a high layer (EAGLE-3's fused feature), all in bf16, and the target's
top-K log-probs at each answer position (for ``distill``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from services.models.prompts import everyday_prompts
from services.training import prompt_bank
from services.training.answers import answer_length, left_padded, pad_and_eos

logger = logging.getLogger(__name__)

DOMAINS = [
    "cooking", "travel", "Python programming", "JavaScript", "SQL databases", "personal finance", "fitness",
    "world history", "physics", "biology", "writing emails at work", "job hunting", "math homework", "home repair",
    "gardening", "music", "movies", "data analysis with pandas", "the Linux command line", "machine learning",
    "productivity", "parenting", "pets", "cars", "language learning", "philosophy", "marketing", "small business",
    "creative writing", "poetry", "health", "chemistry", "astronomy", "geography", "web development", "git",
    "spreadsheets", "statistics", "economics", "psychology", "sports", "art", "fashion", "education", "careers",
]
META_PROMPTS = [
    "Write one question that a user might ask an AI assistant about {d}. Write only the question.",
    "Write one request that someone could send to a helpful assistant about {d}. Write only the request.",
    "Give an example of a task about {d} that a person might ask a chatbot to do. Write only the task.",
]
FOLLOWUPS = {
    "code": ["Can you add comments to the code?", "Now write it in JavaScript.", "What is the time complexity?",
             "Can you add a test for it?", "Explain the code line by line."],
    "prose": ["Can you make it shorter?", "Can you give me an example?", "Explain that in more detail.",
              "Can you turn that into a bulleted list?", "Thanks! What else should I know?"],
}
PASSAGE_TASKS = [
    "Summarize the following text in two sentences:\n\n{t}",
    "Summarize this:\n\n{t}",
    "Give me the key points of this text as a bulleted list:\n\n{t}",
    "Rewrite the following text in a more casual tone:\n\n{t}",
    "Rewrite this text to make it shorter:\n\n{t}",
    "Write a title for this text:\n\n{t}",
]
CODE_KINDS = {"code", "sql", "pandas"}
PASSAGE_MAX_CHARS = 900  # passages fed back for summaries / rewrites stay short enough to batch
FOLLOWUP_EVERY = 4  # one shard of follow-ups after every 4 shards of first turns


@dataclass(frozen=True)
class DataConfig:
    seed: int = 0
    per_subject: int = 6  # templates drawn per training subject
    self_instruct: int = 256  # meta-prompt samples (kept after filtering: fewer)
    instruct_temperature: float = 0.9
    instruct_max_tokens: int = 40
    followups: bool = True  # summaries, rewrites and second turns (see FOLLOWUP_EVERY)
    max_new_tokens: int = 128  # per answer
    batch_size: int = 64
    teacher_top_k: int = 32
    feature_layers: tuple[int, ...] = (2, 15, 27)  # residual stream after these layers (EAGLE-3 low / mid / high)
    num_threads: int = 1  # on a shared 2-core host, 2 OpenMP threads measured 4.6x slower than 1

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def conversation_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class FeatureRecorder:
    """Forward hooks on the target that keep, per forward call, the features drafters read."""

    def __init__(self, model, layers: tuple[int, ...], top_k: int):
        self.steps: list[dict] = []
        self.top_k = top_k
        base = model.model
        self._handles = [base.register_forward_pre_hook(lambda module, args: self.steps.append({}))]
        self._handles.append(base.norm.register_forward_hook(self._keep("final")))
        self._handles += [base.layers[i].register_forward_hook(self._keep(f"layer{i}")) for i in layers]
        self._handles.append(model.lm_head.register_forward_hook(self._top))
        self.layers = layers

    def _keep(self, name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output  # [B, n, hidden]
            self.steps[-1][name] = out.detach().to(torch.bfloat16)

        return hook

    def _top(self, module, args, output):
        logp = torch.log_softmax(output[:, -1].float(), dim=-1)  # [B, vocab_size]
        values, indices = torch.topk(logp, self.top_k, dim=-1)
        self.steps[-1]["top_idx"], self.steps[-1]["top_logp"] = indices.int(), values.half()

    def close(self):
        for h in self._handles:
            h.remove()

    def stacked(self, name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in self.steps], dim=1)  # [B, width + steps - 1, hidden]


@torch.inference_mode()
def answer_batch(model, tokenizer, convs: list[list[int]], cfg: DataConfig, *, record: bool = True,
                 temperature: float = 0.0, max_new_tokens: int | None = None) -> list[dict]:
    """Answer left-padded prompts in one ``generate``; per row: ids, prompt_len and (with ``record``) features."""
    pad, eos = pad_and_eos(model, tokenizer)
    input_ids, attention = left_padded(convs, pad)  # [B, width]
    width = input_ids.shape[1]
    recorder = FeatureRecorder(model, cfg.feature_layers, cfg.teacher_top_k) if record else None
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 0.95} if temperature > 0 else {"do_sample": False}
    try:
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device), pad_token_id=pad,
                             max_new_tokens=max_new_tokens or cfg.max_new_tokens, **sampling)
    finally:
        if recorder is not None:
            recorder.close()
    answers = out[:, width:].cpu()  # [B, T]
    rows = []
    if record:
        final = recorder.stacked("final")  # [B, width + T - 1, hidden]
        fused = torch.cat([recorder.stacked(f"layer{i}") for i in cfg.feature_layers], dim=-1)  # [B, ., 3 hidden]
        top_idx = torch.stack([s["top_idx"] for s in recorder.steps], dim=1)  # [B, T, K]
        top_logp = torch.stack([s["top_logp"] for s in recorder.steps], dim=1)
    for b, prompt in enumerate(convs):
        answer = answers[b].tolist()
        end = answer_length(answer, eos)
        row = {"ids": torch.tensor(prompt + answer[:end], dtype=torch.int32), "prompt_len": len(prompt)}
        if record:
            span = slice(width - len(prompt), width + end - 1)  # features of every position but the last
            row.update(final=final[b, span].clone(), fused=fused[b, span].clone(),
                       top_idx=top_idx[b, :end].clone(), top_logp=top_logp[b, :end].clone())
        rows.append(row)
    return rows


def answer_all(model, tokenizer, conversations: list[list[dict]], cfg: DataConfig, desc: str, **kwargs) -> list[dict]:
    """Answer in batches of similar prompt length; rows come back in input order; a bar shows answer tokens/s."""
    convs = [conversation_ids(tokenizer, c) for c in conversations]
    order = sorted(range(len(convs)), key=lambda i: len(convs[i]))
    batches = [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
    random.Random(cfg.seed).shuffle(batches)  # the bar's rate is representative from the start
    rows: list[dict | None] = [None] * len(convs)
    start, tokens = time.perf_counter(), 0
    bar = tqdm(batches, desc=desc, unit="batch")
    for n, batch in enumerate(bar):
        torch.manual_seed(cfg.seed * 100_003 + n)
        for i, row in zip(batch, answer_batch(model, tokenizer, [convs[i] for i in batch], cfg, **kwargs)):
            rows[i] = row
            tokens += len(row["ids"]) - row["prompt_len"]
        bar.set_postfix(tokens=tokens, tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    logger.info("%s: %d answers, %d answer tokens, %.1f tok/s", desc, len(rows), tokens, tokens / (time.perf_counter() - start))
    return rows


QUOTED = re.compile(r'"([^"]{20,240}[?.])')


def _clean_instruction(text: str) -> str | None:
    """The request in a self-instruct sample: a quoted request if there is one, else the first line."""
    quoted = QUOTED.search(text)
    line = quoted.group(1) if quoted else next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")
    for prefix in ("Question:", "Request:", "Task:", "User:", "Q:", "A:", "-", "*", "1."):
        if line.startswith(prefix):
            line = line[len(prefix):].strip()
    line = line.strip('"“”\' ')
    if not 20 <= len(line) <= 240 or not line.endswith(("?", ".")) or prompt_bank.mentions_held_out(line):
        return None
    if line.endswith(":") or line.lower().startswith(("here", "what a ", "i'm ", "as an ai")):
        return None
    return line


def self_instruct(model, tokenizer, cfg: DataConfig) -> list[str]:
    """User requests written by the target at ``instruct_temperature`` (deduplicated, held-out subjects dropped)."""
    rng = random.Random(cfg.seed + 7)
    metas = [[{"role": "user", "content": rng.choice(META_PROMPTS).format(d=rng.choice(DOMAINS))}]
             for _ in range(cfg.self_instruct)]
    rows = answer_all(model, tokenizer, metas, cfg, "self-instruct", record=False,
                      temperature=cfg.instruct_temperature, max_new_tokens=cfg.instruct_max_tokens)
    found = (_clean_instruction(tokenizer.decode(r["ids"][r["prompt_len"]:], skip_special_tokens=True)) for r in rows)
    return list(dict.fromkeys(f for f in found if f))


def followups(rows: list[dict], tokenizer, rng: random.Random, n: int):
    """Summaries / rewrites of the target's answers and second turns of a chat."""
    out = []
    for i in rng.sample(range(len(rows)), min(n, len(rows))):
        kind, conv = rows[i]["kind"], rows[i]["messages"]
        answer = tokenizer.decode(rows[i]["ids"][rows[i]["prompt_len"]:], skip_special_tokens=True).strip()
        if not answer:
            continue
        if rng.random() < 0.5 and kind not in CODE_KINDS:
            text = answer[:PASSAGE_MAX_CHARS]
            out.append(("passage", [{"role": "user", "content": rng.choice(PASSAGE_TASKS).format(t=text)}]))
        else:
            follow = rng.choice(FOLLOWUPS["code" if kind in CODE_KINDS else "prose"])
            out.append(("chat", conv + [{"role": "assistant", "content": answer}, {"role": "user", "content": follow}]))
    return out


def _user(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def first_turns(model, tokenizer, cfg: DataConfig, shard_dir: Path) -> list[tuple[str, list[dict]]]:
    """Crossed-template and self-instructed prompts (cached), shuffled with the seed."""
    path = shard_dir / "prompts.json"
    if path.is_file():
        return [tuple(x) for x in json.loads(path.read_text())]
    instructions = self_instruct(model, tokenizer, cfg) if cfg.self_instruct else []
    first = [(k, _user(p)) for k, p in prompt_bank.crossed_prompts(cfg.seed, cfg.per_subject)]
    first += [("self_instruct", _user(p)) for p in instructions]
    random.Random(cfg.seed + 3).shuffle(first)
    prompt_bank.check_disjoint([m["content"] for _, conv in first for m in conv])
    path.write_text(json.dumps(first))
    return first


def build(model, tokenizer, cfg: DataConfig, cache_dir: Path, *, max_shards: int | None = None,
          max_seconds: float | None = None) -> dict:
    """Generate (or resume) the training data in shards of one batch; return all shards done so far.

    Every ``FOLLOWUP_EVERY``-th shard holds follow-ups of the first turns
    answered just before it, so any prefix of the shards is a balanced mix and
    a run can stop at a time budget and resume later.
    """
    shard_dir = cache_dir / f"train-{cfg.key()}"
    shard_dir.mkdir(parents=True, exist_ok=True)
    (shard_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    torch.set_num_threads(cfg.num_threads)
    first = first_turns(model, tokenizer, cfg, shard_dir)
    n_first = math.ceil(len(first) / cfg.batch_size)
    plan = []  # (shard kind, index of first-turn batch)
    for b in range(n_first):
        plan.append(("first", b))
        if cfg.followups and (b + 1) % FOLLOWUP_EVERY == 0:
            plan.append(("followup", b))
    plan = plan[:max_shards] if max_shards else plan
    start, tokens = time.perf_counter(), 0
    bar = tqdm(plan, desc="answers", unit="shard")
    for n, (what, b) in enumerate(bar):
        path = shard_dir / f"shard-{n:04d}.pt"
        if path.is_file():
            continue
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            logger.info("time budget spent: stopping before shard %d (resume by calling build again)", n)
            break
        torch.manual_seed(cfg.seed * 100_003 + n)
        if what == "first":
            pairs = first[b * cfg.batch_size : (b + 1) * cfg.batch_size]
        else:
            prev = _load_rows(shard_dir, [m for m, (w, c) in enumerate(plan[:n]) if w == "first" and c > b - FOLLOWUP_EVERY])
            pairs = followups(prev, tokenizer, random.Random(cfg.seed * 31 + n), cfg.batch_size)
        convs = [conversation_ids(tokenizer, c) for _, c in pairs]
        order = sorted(range(len(convs)), key=lambda i: len(convs[i]))
        rows = answer_batch(model, tokenizer, [convs[i] for i in order], cfg)
        for i, row in zip(order, rows):
            row["kind"] = pairs[i][0]
            row["messages"] = pairs[i][1]
        rows = [rows[order.index(i)] for i in range(len(rows))]
        torch.save(rows, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        tokens += sum(len(r["ids"]) - r["prompt_len"] for r in rows)
        bar.set_postfix(tokens=tokens, tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
        logger.info("shard %d (%s): %d answer tokens so far this run, %.1f tok/s", n, what, tokens, tokens / (time.perf_counter() - start))
    return load(cache_dir, cfg)


def _load_rows(shard_dir: Path, shards: list[int]) -> list[dict]:
    return [r for n in shards for r in torch.load(shard_dir / f"shard-{n:04d}.pt")]


def load(cache_dir: Path, cfg: DataConfig, *, max_shards: int | None = None) -> dict:
    """All shards generated so far (in order): {'rows': [...], 'report': {...}}."""
    shard_dir = cache_dir / f"train-{cfg.key()}"
    shards = sorted(shard_dir.glob("shard-*.pt"))[:max_shards]
    rows = [r for path in shards for r in torch.load(path)]
    kinds = [r["kind"] for r in rows]
    report = {
        "data_key": cfg.key(), "shards": len(shards), "answers": len(rows),
        "answer_tokens": sum(len(r["ids"]) - r["prompt_len"] for r in rows),
        "kinds": {k: kinds.count(k) for k in sorted(set(kinds))},
    }
    return {"rows": rows, "report": report}


def build_eval(model, tokenizer, cfg: DataConfig, cache_dir: Path, max_new_tokens: int = 128) -> dict:
    """Held-out (subjects never in training) and everyday sets: {'held_out': rows, 'everyday': rows}."""
    path = cache_dir / f"eval-{cfg.key()}-{max_new_tokens}.pt"
    if path.is_file():
        return torch.load(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, pairs in (("held_out", prompt_bank.held_out_prompts(cfg.seed)), ("everyday", everyday_prompts())):
        rows = answer_all(model, tokenizer, [_user(p) for _, p in pairs], cfg, name, max_new_tokens=max_new_tokens)
        for row, (kind, _) in zip(rows, pairs):
            row["kind"] = kind
        out[name] = rows
    torch.save(out, path)
    return out


def to_distill_data(rows: list[dict]) -> dict:
    """The format ``distill.distil`` trains on: sequences, answer masks, teacher top-K."""
    data = {"sequences": [], "masks": [], "top_idx": [], "top_logp": []}
    for r in rows:
        n, p = len(r["ids"]), r["prompt_len"]
        mask = torch.zeros(n, dtype=torch.bool)
        mask[p - 1 : n - 1] = True  # positions that predict an answer token
        data["sequences"].append(r["ids"].long())
        data["masks"].append(mask)
        data["top_idx"].append(r["top_idx"][: n - p])
        data["top_logp"].append(r["top_logp"][: n - p])
    return data


def main(argv=None):
    """``python -m services.training.selfinstruct --max-seconds 2700``: eval sets, then training shards (resumable)."""
    import argparse

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.models.default_pair import home, target_dir

    parser = argparse.ArgumentParser(description="Generate the drafter's distillation data from the target")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop starting new shards after this long")
    parser.add_argument("--max-shards", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = DataConfig()
    torch.set_num_threads(cfg.num_threads)
    model = AutoModelForCausalLM.from_pretrained(target_dir(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    cache = home() / "selfinstruct"
    build_eval(model, tokenizer, cfg, cache)
    report = build(model, tokenizer, cfg, cache, max_shards=args.max_shards, max_seconds=args.max_seconds)["report"]
    (cache / f"train-{cfg.key()}" / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("data: %s", report)


if __name__ == "__main__":
    main()
