"""Training an EAGLE head for any target, stage by stage: what `splitspec drafter train` runs (splitspec/drafter.py
spreads the stages over a Ray cluster; each stage here is plain torch).

1. **Prompts** (``prompt_pool``): the built-in bank (crossed templates over training subjects, and the training
   prompts), requests the target writes for itself (self-instruct), and the user's own traffic (a JSONL file).
   None may share an 8-gram with Spec-Bench (``contamination``): the yardstick is measured on, never trained on.
2. **Data** (``answer_unit``): unit n answers ``unit_prompts`` first turns of the pool, then follow-ups of its own
   answers (second turns, summaries, rewrites), so every unit is multi-turn and self-contained, seeded by n, and
   saved as one small file of token ids: units run anywhere, in any order, a killed run loses only the units in
   flight, and a run's data can be kept (committed) to resume in another session. Answers are greedy, and sampled
   for every ``sampled_every``-th unit and every unit past the pool's first pass; the engine's runner answers them
   with continuous batching where its compact forward runs (a Llama on a CPU: ``answer_runner``), transformers'
   ``generate`` elsewhere.
3. **Features** (``featurize``): what a head learns from, from one teacher-forced pass of the target over each
   answered conversation (the same positions generation computed): the final-norm feature (EAGLE), the residual
   stream after a low, a mid and a high layer (EAGLE-3's fused feature), and the target's top-K log-probs at each
   answer position. Kept beside the run, not with the data: they are 500x its size and recomputed at will.
4. **Training** (``train_variant``): each variant on the same units, streamed from disk one unit at a time.
5. **Report** (``evaluate``): acceptance by draft position and mean accepted length at k = 1..4 (k = 3 headline),
   teacher-forced along the target's own greedy answers, per category of Spec-Bench and the held-out prompts; the
   draft cost against a target step.
6. **Install** (``install``): the winner beside a drafter, with the target's identity (a head made for another
   target is refused when loaded).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from services import fast_llama
from services.loading import wrap_model
from services.models import eagle, specbench
from services.training import contamination, eagle_train, prompt_bank, selfinstruct
from services.training.acceptance import acceptance, eagle_drafts
from services.training.answers import continuous_answers, pad_and_eos, sampled_params
from services.training.prompts import train_prompts

logger = logging.getLogger(__name__)

VARIANTS = ("final", "fused")  # EAGLE's final-norm feature; EAGLE-3's fused low / mid / high layers
UNIT_FILE = "unit-{:05d}.pt"
HEAD_FILE, REPORT_FILE = "eagle_head.safetensors", "eagle_head.json"  # as services.eagle_draft finds them


@dataclass(frozen=True)
class TrainJob:
    """Everything that decides a run's data and head (saved as job.json; ``--resume`` continues the same job)."""

    target: str  # the target's folder
    tokens: int = 2_000_000  # answer tokens to train on (the first units holding them; generated where lacking)
    seed: int = 0
    unit_prompts: int = 32  # first turns a unit answers (one generate batch)
    unit_followups: int = 16  # follow-ups of its own answers a unit answers after them
    max_new_tokens: int = 128
    sampled_every: int = 4  # every 4th unit's answers are sampled; the rest greedy (until the pool is used up)
    temperature: float = 0.8
    self_instruct: int = 256  # requests the target is asked to write (kept after filtering: fewer)
    per_subject: int = 6  # crossed templates per training subject
    user_prompts_sha256: str = ""  # of the user's prompt file, if any
    teacher_top_k: int = 32
    variants: tuple[str, ...] = VARIANTS
    draft_vocab: int = 8192  # kept ids (the most frequent in the answers); 0 = all
    ttt_steps: int = 3
    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 4
    train_seconds: float = 0.0  # per variant; 0 = the epochs
    eval_prompts: int = 48  # Spec-Bench first turns the report measures on (spread over its six categories)
    eval_held_out: int = 24
    eval_max_new_tokens: int = 96
    init: str = ""  # a saved head this run goes on training (its units are skipped): a run in stages

    def data_fields(self) -> dict:
        """What the data depends on (``--resume`` may change the rest, e.g. more tokens or another schedule)."""
        keep = ("seed", "unit_prompts", "unit_followups", "max_new_tokens", "sampled_every", "temperature",
                "self_instruct", "per_subject", "user_prompts_sha256", "teacher_top_k")
        return {k: v for k, v in asdict(self).items() if k in keep}

    def eagle_config(self, feature: str) -> eagle.EagleConfig:
        return eagle.EagleConfig(feature=feature, draft_vocab=self.draft_vocab, ttt_steps=self.ttt_steps,
                                 epochs=self.epochs, lr=self.lr, batch_size=self.batch_size, seed=self.seed)


def data_recipe(job: TrainJob) -> dict:
    """What a data folder's units were made with: the job's data fields and the target's identity (its config's
    hash, not its path: the data can move between machines)."""
    from services import eagle_draft
    from services.loading import config_of

    return job.data_fields() | {"target": eagle_draft.target_identity(config_of(job.target))}


def open_data(job: TrainJob, data: Path) -> None:
    """Use ``data`` for ``job``'s units: a new folder, or one made with the same recipe (its units are kept)."""
    data.mkdir(parents=True, exist_ok=True)
    path, recipe = data / "recipe.json", data_recipe(job)
    if path.is_file():
        saved = json.loads(path.read_text())
        changed = {k: (saved.get(k), v) for k, v in recipe.items() if saved.get(k) != v}
        if changed:
            raise ValueError(f"{data} holds units of another recipe ({changed}): use another folder")
    else:
        path.write_text(json.dumps(recipe, indent=2) + "\n")


def feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, mid and high layers for a target of ``num_layers`` (2, 15, 27 for the default's 30)."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)}))


def data_config(job: TrainJob, model) -> selfinstruct.DataConfig:
    return selfinstruct.DataConfig(seed=job.seed, max_new_tokens=job.max_new_tokens, batch_size=job.unit_prompts,
                                   teacher_top_k=job.teacher_top_k,
                                   feature_layers=feature_layers(model.config.num_hidden_layers),
                                   num_threads=torch.get_num_threads())


# -- 1. prompts -------------------------------------------------------------------------------------------------


def read_user_prompts(path: Path) -> list[tuple[str, list[dict]]]:
    """A JSONL file of the user's traffic: each line {"prompt": "..."} or {"messages": [{"role", "content"}, ...]}
    (OpenAI chat format; the conversation up to its last user turn). Refused if any turn shares an 8-gram with
    Spec-Bench or MT-Bench."""
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            messages = item["messages"] if "messages" in item else [{"role": "user", "content": item["prompt"]}]
            messages = [{"role": m["role"], "content": str(m["content"])} for m in messages]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected {{\"prompt\": ...}} or {{\"messages\": [...]}} ({exc})") from None
        while messages and messages[-1]["role"] != "user":
            messages.pop()  # (a logged conversation's answer: the target writes its own)
        if messages:
            pairs.append(("user", messages))
    contamination.check((m["content"] for _, conv in pairs for m in conv), str(path))
    if not pairs:
        raise ValueError(f"{path} holds no prompt")
    return pairs


def prompt_pool(job: TrainJob, model, tokenizer, user: list[tuple[str, list[dict]]] = ()) -> list[tuple[str, list[dict]]]:
    """The first turns units answer, shuffled with the seed: the user's first (they matter most), then the bank."""
    cfg = replace(data_config(job, model), self_instruct=job.self_instruct)
    bank = [(kind, _user(p)) for kind, p in prompt_bank.crossed_prompts(job.seed, job.per_subject)]
    bank += [("train", _user(p)) for p in train_prompts(job.seed)]
    bank += [("self_instruct", _user(p)) for p in (selfinstruct.self_instruct(model, tokenizer, cfg) if job.self_instruct else [])]
    contamination.check((m["content"] for _, conv in bank for m in conv), "the built-in prompts")
    rng = random.Random(job.seed + 3)
    user, bank = list(user), list(bank)
    rng.shuffle(user)
    rng.shuffle(bank)
    # the user's prompts spread through the pool, one in every few, so that any first units hold some
    pool, every = [], max(1, len(bank) // max(1, len(user)))
    for i, item in enumerate(bank):
        if user and i % every == 0:
            pool.append(user.pop())
        pool.append(item)
    return pool + user


def _user(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# -- 2. data ----------------------------------------------------------------------------------------------------


def unit_temperature(job: TrainJob, n: int, pool_size: int) -> float:
    first_pass = (n + 1) * job.unit_prompts <= pool_size
    return job.temperature if not first_pass or n % job.sampled_every == job.sampled_every - 1 else 0.0


def answer_runner(model):
    """The engine's runner to answer units with (``answers.continuous_answers``) where a pass batches sequences:
    the compact forward of a Llama on a CPU; None elsewhere (a GPU, another architecture): transformers' generate
    over left-padded batches, which batches there."""
    if model.device.type != "cpu" or not fast_llama.supports(model.config):
        return None
    return fast_llama.FastLlamaRunner(wrap_model(model, model_id="target", device="cpu"))


def answer_unit(model, tokenizer, job: TrainJob, pool: list, n: int, runner=None) -> list[dict]:
    """Unit ``n``: its first turns (taken from the pool in order, wrapping around), then follow-ups of them. Each
    row: ids, prompt_len, kind, temperature (and messages, dropped when saved). ``runner``: ``answer_runner``'s."""
    cfg = data_config(job, model)
    torch.manual_seed(job.seed * 100_003 + n)  # transformers' generate samples from the global generator
    generator = torch.Generator().manual_seed(job.seed * 100_003 + n)  # the runner's draws
    start = n * job.unit_prompts
    first = [pool[(start + i) % len(pool)] for i in range(job.unit_prompts)]
    temperature = unit_temperature(job, n, len(pool))
    answer = functools.partial(_answer, model, tokenizer, cfg=cfg, temperature=temperature, runner=runner,
                               generator=generator)
    rows = answer(first)
    return rows + answer(selfinstruct.followups(rows, tokenizer, random.Random(job.seed * 1_000_003 + n),
                                                job.unit_followups))


def _answer(model, tokenizer, pairs: list, cfg: selfinstruct.DataConfig, temperature: float, *,
            record: bool = False, runner=None, generator: torch.Generator | None = None) -> list[dict]:
    """Rows in ``pairs``' order: ids (prompt + answer, int32), prompt_len, kind, messages (dropped when saved),
    temperature; with ``record``, the features too (the evaluation sets: transformers' generate records them)."""
    if not pairs:
        return []
    convs = [selfinstruct.conversation_ids(tokenizer, conv) for _, conv in pairs]
    if runner is not None and not record:
        _, eos = pad_and_eos(model, tokenizer)
        answers = continuous_answers(runner, convs, eos=eos, max_new_tokens=cfg.max_new_tokens,
                                     params=sampled_params(temperature), generator=generator, slots=cfg.batch_size)
        answered = [{"ids": torch.tensor(c + a, dtype=torch.int32), "prompt_len": len(c)} for c, a in zip(convs, answers)]
    else:
        order = sorted(range(len(convs)), key=lambda i: len(convs[i]))  # similar lengths pad less
        by_length = selfinstruct.answer_batch(model, tokenizer, [convs[i] for i in order], cfg,
                                              temperature=temperature, record=record)
        answered = [{}] * len(convs)
        for i, row in zip(order, by_length):
            answered[i] = row
    return [row | {"kind": kind, "messages": conv, "temperature": temperature}
            for row, (kind, conv) in zip(answered, pairs, strict=True)]


FEATURE_BATCH = 8  # conversations per teacher-forced pass


@torch.inference_mode()
def featurize(model, rows: list[dict], job: TrainJob) -> list[dict]:
    """``rows`` with what a head learns from, from teacher-forced passes of the target (right padded, batches of
    similar length): ``final`` [n - 1, hidden] and ``fused`` [n - 1, 3 hidden] features of every position but the
    last (bf16; ``fused`` only if the job trains that variant), ``top_idx`` / ``top_logp`` [n - p, K] of the
    target's distribution at each answer position."""
    layers = feature_layers(model.config.num_hidden_layers)
    out: list[dict] = [{}] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["ids"]))
    for start in range(0, len(order), FEATURE_BATCH):
        batch = order[start : start + FEATURE_BATCH]
        width = max(len(rows[i]["ids"]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, width] right padded
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, i in enumerate(batch):
            n = len(rows[i]["ids"])
            ids[b, :n], mask[b, :n] = rows[i]["ids"].long(), 1
        hidden = model.model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             output_hidden_states="fused" in job.variants)
        final = hidden.last_hidden_state  # [B, width, h] (after the final norm)
        for b, i in enumerate(batch):
            n, p = len(rows[i]["ids"]), rows[i]["prompt_len"]
            logp = torch.log_softmax(model.lm_head(final[b, p - 1 : n - 1]).float(), dim=-1)  # [n - p, vocab]
            top_logp, top_idx = torch.topk(logp, job.teacher_top_k, dim=-1)
            out[i] = rows[i] | {"final": final[b, : n - 1].to("cpu", torch.bfloat16).clone(),
                                "top_idx": top_idx.int().cpu(), "top_logp": top_logp.half().cpu()}
            if "fused" in job.variants:  # [n - 1, 3 h]
                out[i]["fused"] = torch.cat([hidden.hidden_states[j + 1][b, : n - 1] for j in layers], dim=-1).to(
                    "cpu", torch.bfloat16).clone()
    return out


def answer_tokens(rows: list[dict]) -> int:
    return sum(len(r["ids"]) - r["prompt_len"] for r in rows)


def save_unit(rows: list[dict], path: Path) -> None:
    """Write atomically: a unit file is whole or absent (a killed run redoes only what was in flight)."""
    tmp = path.with_suffix(".tmp")
    torch.save(rows, tmp)
    tmp.rename(path)


def unit_data(rows: list[dict]) -> list[dict]:
    """What a unit file keeps: ids (prompt + answer), prompt_len, kind, temperature (no text, no features)."""
    keep = ("ids", "prompt_len", "kind", "temperature")
    return [{k: r[k] for k in keep} for r in rows]


def unit_paths(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("unit-*.pt"))


# -- 3. training ------------------------------------------------------------------------------------------------


def kept_vocabulary(paths: list[Path], size: int, vocab_size: int) -> torch.Tensor:
    """eagle_train.kept_vocabulary over the units' rows, read one file at a time."""
    return eagle_train.kept_vocabulary((r for path in paths for r in torch.load(path, mmap=True)), size, vocab_size)


def unit_batches(paths: list[Path], batch_size: int, *, rank: int = 0, world: int = 1):
    """An epoch factory for ``eagle_train.train_batches``: the units in a seeded order, one loaded at a time, each
    cut into batches of similar length; worker ``rank`` of ``world`` takes every world-th batch. Returns it and
    the number of batches an epoch yields on this worker."""
    sizes = {p: -(-unit_rows(p) // batch_size) for p in paths}
    per_epoch = sum(sizes.values()) // world

    def epoch(generator: torch.Generator):
        order = torch.randperm(len(paths), generator=generator).tolist()
        i = 0
        for u in order:
            rows = sorted(torch.load(paths[u]), key=lambda r: len(r["ids"]))
            batches = [rows[j : j + batch_size] for j in range(0, len(rows), batch_size)]
            for b in torch.randperm(len(batches), generator=generator).tolist():
                if i % world == rank and i // world < per_epoch:
                    yield batches[b]
                i += 1

    return epoch, per_epoch


_ROWS: dict[Path, int] = {}


def unit_rows(path: Path) -> int:
    if path not in _ROWS:
        _ROWS[path] = len(torch.load(path, mmap=True))
    return _ROWS[path]


def new_head(target, job: TrainJob, feature: str, paths: list[Path]) -> eagle.EagleHead:
    cfg = job.eagle_config(feature)
    kept = kept_vocabulary(paths, cfg.draft_vocab, target.config.vocab_size)
    feature_dim = torch.load(paths[0], mmap=True)[0][feature].shape[-1]
    return eagle.EagleHead(target, cfg, kept, feature_dim)


def init_head(target, job: TrainJob, feature: str) -> eagle.EagleHead:
    """The head ``job.init`` names, to go on training with ``job``'s schedule (its kept ids stay)."""
    head = eagle.load_head(target, job.init)
    if head.cfg.feature != feature:
        raise ValueError(f"--init {job.init} is a {head.cfg.feature!r} head, not {feature!r}")
    head.cfg = replace(job.eagle_config(feature), draft_vocab=head.cfg.draft_vocab)
    return head.requires_grad_(True)


def train_variant(target, job: TrainJob, feature: str, paths: list[Path], *, rank: int = 0, world: int = 1,
                  sync_gradients=None, agree=None, checkpoint=None, device: str | torch.device = "cpu",
                  ) -> tuple[eagle.EagleHead, list[dict]]:
    """One head of ``feature`` trained on the units (the same data and schedule for each variant), on ``device``;
    returned on the CPU."""
    torch.manual_seed(job.seed)
    head = (init_head(target, job, feature) if job.init else new_head(target, job, feature, paths)).to(device).train()
    epoch, per_epoch = unit_batches(paths, job.batch_size, rank=rank, world=world)
    log = eagle_train.train_batches(head, epoch, per_epoch, head.cfg, job.teacher_top_k,
                                    max_seconds=job.train_seconds or None, checkpoint=checkpoint,
                                    sync_gradients=sync_gradients, agree=agree)
    return head.cpu().eval(), log


# -- 4. report --------------------------------------------------------------------------------------------------


def eval_prompts(job: TrainJob) -> dict[str, list[list[dict]]]:
    """Spec-Bench first turns (the first ``eval_prompts``, dealt over its six categories) and held-out prompts."""
    sets: dict[str, list[list[dict]]] = {}
    for q in specbench.interleaved(job.seed)[: job.eval_prompts]:
        sets.setdefault(f"specbench/{q.category}", []).append(_user(q.first_turn))
    sets["held_out"] = [_user(p) for _, p in prompt_bank.held_out_prompts(job.seed)[: job.eval_held_out]]
    return sets


def answer_eval(model, tokenizer, job: TrainJob) -> dict[str, list[dict]]:
    """The target's greedy answers (with features) to the prompts the report measures on, by set."""
    cfg = replace(data_config(job, model), max_new_tokens=job.eval_max_new_tokens)
    return {name: _answer(model, tokenizer, [(name, c) for c in convs], cfg, 0.0, record=True)
            for name, convs in eval_prompts(job).items()}


def evaluate(head: eagle.EagleHead, sets: dict[str, list[dict]], ks=(1, 2, 3, 4)) -> dict:
    """Per set: acceptance by position and mean accepted length at each k; "specbench" pools its categories."""
    per_set = {name: acceptance(lambda r, s: eagle_drafts(head, r, s), rows, ks) for name, rows in sets.items()}
    pooled = [r for name, rows in sets.items() if name.startswith("specbench/") for r in rows]
    if pooled:
        per_set["specbench"] = acceptance(lambda r, s: eagle_drafts(head, r, s), pooled, ks)
    return per_set


def draft_cost(head: eagle.EagleHead, target, row: dict, context: int = 160, repeats: int = 21) -> dict:
    """One draft token and one target decode step at the same context, 1 thread (ms, and their ratio c)."""
    from services.loading import wrap_model
    from services.runner import make_runner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = row["ids"][:context].long()
        runner = make_runner(wrap_model(target, model_id="target"))
        cache = runner.new_cache()
        runner.forward(ctx, cache, last_only=True)

        def step():
            runner.forward(ctx[-1:], cache, last_only=True)
            cache.crop(len(ctx))

        session = eagle.HeadSession(head)
        session.extend(row[head.cfg.feature][: len(ctx)].float(), row["ids"][1 : len(ctx) + 1])

        def draft():
            session.draft_one()
            session.rollback()

        target_ms, draft_ms = median_ms(step, repeats), median_ms(draft, repeats)
    finally:
        torch.set_num_threads(threads)
    return {"target_step_ms": target_ms, "draft_token_ms": draft_ms, "c": round(draft_ms / target_ms, 4)}


def median_ms(fn, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``fn`` after one untimed (ms)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[len(times) // 2] * 1000, 3)


def headline(result: dict) -> float:
    """What picks the winner: Spec-Bench's mean accepted length at k = 3 (held-out's if there is no Spec-Bench)."""
    part = result["acceptance"].get("specbench") or result["acceptance"]["held_out"]
    return part["k3"]["mean_accepted_length"]


# -- 5. install -------------------------------------------------------------------------------------------------


def save_head(head: eagle.EagleHead, report: dict, folder: Path, target_config) -> Path:
    """The head as serve loads it (services.eagle_draft), its report beside it naming the target it belongs to."""
    from services import eagle_draft

    folder.mkdir(parents=True, exist_ok=True)
    path = eagle.save_head(head, folder / HEAD_FILE)
    report = report | {"target": eagle_draft.target_identity(target_config)}
    (folder / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return path


def install(head_dir: Path, drafter_dir: Path) -> Path:
    """Copy a saved head and its report into a drafter folder, where `splitspec serve` finds it (the report names
    the target: serve refuses the head for another)."""
    from services import eagle_draft

    if not (drafter_dir / "config.json").is_file():
        raise ValueError(f"{drafter_dir} is no drafter folder (no config.json): install the head beside a drafter")
    shutil.copy(head_dir / HEAD_FILE, drafter_dir / eagle_draft.HEAD_FILE)
    shutil.copy(head_dir / REPORT_FILE, drafter_dir / eagle_draft.HEAD_REPORT)
    return drafter_dir / eagle_draft.HEAD_FILE


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
