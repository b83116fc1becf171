"""`splitspec drafter train`: an EAGLE head for any target, on a Ray cluster (services.training.pipeline holds
the stages; this spreads them).

- Data: Ray actors, one per GPU (or per CPU on a CPU cluster), each loading the target once, answer units; the
  driver saves each unit as it comes back (through the object store: no shared file system needed), so a killed run
  resumes (``--resume``) with the units it has. A bar shows answer tokens and the ETA.
- Training: Ray Train (``TorchTrainer``), each variant in turn, data-parallel over the workers of the driver's node
  (which holds the data), gradients all-reduced each step.
- Report and install: on the driver.

Out folder: job.json, prompts.json, data/unit-NNNNN.pt (token ids: small, kept apart with ``--data`` to commit or
share them), features/ (features-final/ without the fused ones; recomputed from the data at will), eval.pt,
heads/<variant>/, report.json, report.md and head/ (the winner, as serve loads it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from services.models import eagle
from services.training import pipeline
from services.training.pipeline import TrainJob

logger = logging.getLogger(__name__)

SERVABLE = ("final",)  # serving hands the head only the final-norm features (services.eagle_draft)


def load_target(path: str, threads: int = 1):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


# -- the job and its folder -------------------------------------------------------------------------------------


def open_job(job: TrainJob, out: Path, resume: bool) -> TrainJob:
    """Check that ``job`` may start in ``out``, or continue the job saved there (``resume``): the data must be the
    same recipe; the token budget and the training schedule may change. Writes nothing (``save_job``)."""
    path = out / "job.json"
    if path.is_file():
        if not resume:
            raise SystemExit(f"{out} holds a run already: pass --resume to continue it, or choose another --out")
        saved = TrainJob(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(path.read_text()).items()})
        before = saved.data_fields()
        changed = {k: (before[k], v) for k, v in job.data_fields().items() if before[k] != v}
        if saved.target != job.target:
            changed["target"] = (saved.target, job.target)
        if changed:
            raise SystemExit(f"--resume: the data recipe differs from the saved run's ({changed}); use another --out")
        if saved.init and not job.init:  # (a stage goes on as the stage it is)
            job = replace(job, init=saved.init)
    elif resume:
        raise SystemExit(f"--resume: {out} holds no run to resume")
    return job


def save_job(job: TrainJob, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(asdict(job), indent=2) + "\n")


def connect(address: str | None) -> None:
    """Join the cluster at ``address``, or start a local one with every CPU of this machine (loopback only)."""
    import ray

    from splitspec import cluster

    cluster.ray_env()
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    cluster.loopback_only()
    ray.init("local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,  # (a cluster of its own)
             object_store_memory=cluster.OBJECT_STORE_BYTES * 2)


# -- data -------------------------------------------------------------------------------------------------------


def _worker_class():
    import ray

    @ray.remote(max_restarts=3, max_task_retries=3)  # a lost worker comes back and takes its unit again
    class UnitWorker:
        """Loads the target once; answers units (a unit is seeded by its number: a retry answers it alike)."""

        def __init__(self, job: TrainJob, pool: list, threads: int):
            self.job, self.pool = job, pool
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model, self.tokenizer = load_target(job.target, threads)
            self.model.to(device)
            self.runner = pipeline.answer_runner(self.model)

        def unit(self, n: int) -> list[dict]:
            return pipeline.unit_data(pipeline.answer_unit(self.model, self.tokenizer, self.job, self.pool, n, self.runner))

        def featurize(self, rows: list[dict]) -> list[dict]:
            return pipeline.featurize(self.model, rows, self.job)

        def eval_sets(self) -> dict:
            return pipeline.answer_eval(self.model, self.tokenizer, self.job)

        def pool_of(self, user: list) -> list:
            return pipeline.prompt_pool(self.job, self.model, self.tokenizer, user)

    return UnitWorker


def worker_options() -> tuple[int, dict, int]:
    """How many data workers, each one's Ray resources and torch threads: one per GPU, else one per CPU."""
    import ray

    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
    if gpus:
        return gpus, {"num_gpus": 1, "num_cpus": 1}, 1
    return max(1, cpus), {"num_cpus": 1}, 1


def prompts(job: TrainJob, data: Path, user: list) -> list:
    """The prompt pool, made once (the target's self-instruct samples) and kept with the units that index it."""
    import ray

    path = data / "prompts.json"
    if path.is_file():
        return [tuple(x) for x in json.loads(path.read_text())]
    worker = _worker_class().options(num_cpus=1).remote(job, [], 1)
    pool = ray.get(worker.pool_of.remote(user))
    ray.kill(worker)
    path.write_text(json.dumps(pool))
    return pool


def generate(job: TrainJob, data: Path, pool: list) -> int:
    """Units until the saved ones hold ``job.tokens`` answer tokens; returns the answer tokens saved."""
    import ray
    from tqdm.auto import tqdm

    done = {int(p.stem.split("-")[1]): pipeline.answer_tokens(torch.load(p)) for p in pipeline.unit_paths(data)}
    tokens = sum(done.values())
    if tokens >= job.tokens:
        return tokens
    n_workers, options, threads = worker_options()
    pool_ref = ray.put(pool)
    workers = [_worker_class().options(**options).remote(job, pool_ref, threads) for _ in range(n_workers)]
    per_unit = (sum(done.values()) / len(done)) if done else (job.unit_prompts + job.unit_followups) * job.max_new_tokens * 0.6
    bar = tqdm(total=job.tokens, initial=min(tokens, job.tokens), unit="tok", desc="answers", smoothing=0.05)
    next_unit = iter(n for n in range(10**9) if n not in done)
    pending: dict = {}  # ref -> (unit, worker)
    idle = list(workers)
    try:
        while True:
            while idle and tokens + len(pending) * per_unit < job.tokens:
                n, worker = next(next_unit), idle.pop()
                pending[worker.unit.remote(n)] = (n, worker)
            if not pending:
                break
            ready, _ = ray.wait(list(pending), num_returns=1)
            n, worker = pending.pop(ready[0])
            rows = ray.get(ready[0])
            pipeline.save_unit(rows, data / pipeline.UNIT_FILE.format(n))
            done[n] = pipeline.answer_tokens(rows)
            tokens += done[n]
            per_unit = tokens / len(done)
            bar.update(min(done[n], max(0, job.tokens - bar.n)))
            bar.set_postfix(units=len(done))
            idle.append(worker)
    finally:
        bar.close()
        for w in workers:
            ray.kill(w)
    return tokens


def init_stage(job: TrainJob) -> dict:
    """What the head ``--init`` names was trained on (its report beside it): refused if it was made for another
    target or from data of another recipe. Returns {"units", "answer_tokens", "stages"}."""
    from services import eagle_draft
    from services.loading import config_of

    path = Path(job.init)
    report_path = path.with_name(pipeline.REPORT_FILE)
    if not path.is_file() or not report_path.is_file():
        raise SystemExit(f"--init: {path} is no saved head with its report ({report_path.name}) beside it")
    report = json.loads(report_path.read_text())
    if not isinstance(report.get("units"), int) or not isinstance(report.get("answer_tokens"), int):
        raise SystemExit(f"--init: {report_path} does not say which units the head has seen (a head from "
                         "`splitspec drafter train` does)")
    if report.get("target") != eagle_draft.target_identity(config_of(job.target)):
        raise SystemExit(f"--init: {path} was trained for another target than {job.target}")
    feature = eagle.head_config(path).feature
    if tuple(job.variants) != (feature,):
        raise SystemExit(f"--init: {path} is a {feature!r} head; it goes on as that variant alone (--variants {feature})")
    saved = report.get("job", {})
    changed = {k: (saved.get(k), v) for k, v in job.data_fields().items() if saved.get(k) != v}
    if changed:
        raise SystemExit(f"--init: {path} was trained on data of another recipe ({changed})")
    stages = report.get("stages") or [{"units": report["units"], "answer_tokens": report["answer_tokens"],
                                       "epochs": saved.get("epochs"), "lr": saved.get("lr")}]
    return {"units": report["units"], "answer_tokens": report["answer_tokens"], "stages": stages}


def training_units(job: TrainJob, data: Path) -> tuple[list[Path], list[int]]:
    """The units a run trains on, and each one's answer tokens: the first ones (by number) that hold ``job.tokens``,
    so that runs over one data folder with growing ``--tokens`` give the curve of a head against its data."""
    chosen, counts = [], []
    for path in pipeline.unit_paths(data):
        if sum(counts) >= job.tokens:
            break
        chosen.append(path)
        counts.append(pipeline.answer_tokens(torch.load(path)))
    return chosen, counts


def featurize(job: TrainJob, units: list[Path], features: Path) -> list[Path]:
    """The units' features (a teacher-forced pass each, on the data workers); returns the feature files."""
    import ray
    from tqdm.auto import tqdm

    features.mkdir(parents=True, exist_ok=True)
    todo = [p for p in units if not (features / p.name).is_file()]
    if todo:
        n_workers, options, threads = worker_options()
        workers = [_worker_class().options(**options).remote(job, [], threads) for _ in range(min(n_workers, len(todo)))]
        pending, idle, queue = {}, list(workers), list(todo)
        bar = tqdm(total=len(todo), unit="unit", desc="features")
        try:
            while queue or pending:
                while idle and queue:
                    path, worker = queue.pop(0), idle.pop()
                    pending[worker.featurize.remote(torch.load(path))] = (path, worker)
                ready, _ = ray.wait(list(pending), num_returns=1)
                path, worker = pending.pop(ready[0])
                pipeline.save_unit(ray.get(ready[0]), features / path.name)
                bar.update(1)
                idle.append(worker)
        finally:
            bar.close()
            for w in workers:
                ray.kill(w)
    return [features / p.name for p in units]


def eval_sets(job: TrainJob, out: Path) -> dict:
    import ray

    path = out / "eval.pt"
    if path.is_file():
        return torch.load(path)
    worker = _worker_class().options(num_cpus=1).remote(job, [], 1)
    sets = ray.get(worker.eval_sets.remote())
    ray.kill(worker)
    torch.save(sets, path)
    return sets


# -- training ---------------------------------------------------------------------------------------------------


def _train_loop(config: dict) -> None:
    """One Ray Train worker: its share of every epoch's batches; gradients all-reduced (mean) before each step."""
    import ray.train
    import torch.distributed as dist
    from ray.train.torch import get_device

    job = TrainJob(**config["job"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(1)
    model, _ = load_target(job.target, 1)
    paths = [Path(p) for p in config["paths"]]

    def sync(params):
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world

    def agree(progress: float) -> float:
        value = torch.tensor([progress], device=get_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item()

    out = Path(config["out"])
    head, log = pipeline.train_variant(model, job, config["variant"], paths, rank=rank, world=world,
                                       sync_gradients=sync if world > 1 else None, agree=agree if world > 1 else None,
                                       device=get_device())
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        eagle.save_head(head, out / TRAINED_HEAD, dtype=torch.float32)
        (out / TRAINED_ON).write_text(json.dumps({"units": [p.name for p in paths], "job": config["job"]}))
        (out / "log.json").write_text(json.dumps(log))
    ray.train.report({"steps": len(log), "loss": log[-1]["loss"] if log else None})


def train(job: TrainJob, out: Path, variant: str, workers: int, paths: list[Path]) -> None:
    """Train ``variant`` with Ray Train on the driver's node (its data), ``workers`` data-parallel workers."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    node = f"node:{ray.util.get_node_ip_address()}"
    gpu = torch.cuda.is_available()
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"job": asdict(job), "variant": variant, "out": str(out / "heads" / variant),
                           "paths": [str(p.resolve()) for p in paths]},
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu, resources_per_worker={"CPU": 1, node: 0.001}),
        run_config=RunConfig(name=f"head-{variant}", storage_path=str((out / "ray_train").resolve())),
    )
    trainer.fit()


TRAINED_HEAD, TRAINED_ON = "head.safetensors", "trained_on.json"  # a variant's head (float32) and its units and job


def trained_on(out: Path, variant: str, paths: list[Path], job: TrainJob) -> bool:
    """Whether ``variant``'s saved head was trained on exactly these units with this job (else: train it again)."""
    folder = out / "heads" / variant
    if not (folder / TRAINED_HEAD).is_file() or not (folder / TRAINED_ON).is_file():
        return False
    saved = json.loads((folder / TRAINED_ON).read_text())
    return saved == json.loads(json.dumps({"units": [p.name for p in paths], "job": asdict(job)}))


def load_trained(target, out: Path, variant: str):
    return eagle.load_head(target, out / "heads" / variant / TRAINED_HEAD)


# -- the command ------------------------------------------------------------------------------------------------


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    user_path = Path(args.prompts) if args.prompts else None
    try:
        user = pipeline.read_user_prompts(user_path) if user_path else []  # (refused before anything starts)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    init = Path(args.init) if args.init else None
    if init is not None and init.is_dir():
        init = init / pipeline.HEAD_FILE
    job = TrainJob(target=str(Path(args.target).resolve()), tokens=args.tokens, seed=args.seed,
                   init=str(init.resolve()) if init else "",
                   user_prompts_sha256=pipeline.file_sha256(user_path) if user_path else "",
                   **{k: v for k, v in vars(args).items() if k in TUNABLE and v is not None})
    job = open_job(job, out, args.resume)
    before = init_stage(job) if job.init else {"units": 0, "answer_tokens": 0, "stages": []}
    if job.init and job.tokens <= before["answer_tokens"]:
        raise SystemExit(f"--init: the head has seen {before['answer_tokens']} answer tokens already: raise --tokens")
    data = Path(args.data) if args.data else out / "data"
    try:
        pipeline.open_data(job, data)  # (a data folder of another recipe is refused before the run is written)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    save_job(job, out)
    started = time.time()
    connect(args.address)
    pool = prompts(job, data, user)
    print(f"prompts: {len(pool)} first turns ({sum(1 for k, _ in pool if k == 'user')} yours)", flush=True)
    generate(job, data, pool)
    units, counts = training_units(job, data)
    tokens, seen = sum(counts), sum(counts[: before["units"]])
    if seen != before["answer_tokens"]:
        raise SystemExit(f"--init: the head's report says it saw {before['answer_tokens']} answer tokens in the first "
                         f"{before['units']} units, but those of {data} hold {seen}: another data folder?")
    units = units[before["units"]:]  # (a head going on is trained on the units after those it has seen)
    stage = {"units": len(units), "answer_tokens": tokens - before["answer_tokens"], "epochs": job.epochs, "lr": job.lr}
    paths = featurize(job, units, out / ("features" if "fused" in job.variants else "features-final"))
    print(f"data: {stage['answer_tokens']} answer tokens in {len(paths)} units ({data})"
          + (f", after the {before['units']} units --init has seen" if job.init else ""), flush=True)
    sets = eval_sets(job, out)
    workers = args.train_workers or min(2, max(1, os.cpu_count() or 1))
    target, _ = load_target(job.target, torch.get_num_threads())
    results = {}
    for variant in job.variants:
        if not trained_on(out, variant, paths, job):
            print(f"training the {variant!r} head", flush=True)
            train(job, out, variant, workers, paths)
        head = load_trained(target, out, variant)
        row = max(sets["held_out"], key=lambda r: len(r["ids"]))
        results[variant] = {"acceptance": pipeline.evaluate(head, sets),
                            "cost": pipeline.draft_cost(head, target, row),
                            "steps": len(json.loads((out / "heads" / variant / "log.json").read_text())),
                            "parameters": sum(p.numel() for p in head.trainable_state().values())}
    servable = [v for v in results if v in SERVABLE]
    best = max(results, key=lambda v: pipeline.headline(results[v]))
    winner = max(servable, key=lambda v: pipeline.headline(results[v])) if servable else None
    report = {"job": asdict(job), "answer_tokens": tokens, "units": before["units"] + len(paths),
              "stages": before["stages"] + [stage], "variants": results,
              "best": best, "installed_variant": winner, "seconds": round(time.time() - started, 1)}
    if winner != best:
        report["note"] = (f"{best!r} measured best, but serving hands the head only the final-norm features: "
                          f"{winner!r} is the head to serve")
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(report))
    print(report_markdown(report), flush=True)
    if winner:
        head_dir = out / "head"
        pipeline.save_head(load_trained(target, out, winner), report, head_dir, target.config)
        print(f"head: {head_dir / pipeline.HEAD_FILE}", flush=True)
        if args.install:
            path = pipeline.install(head_dir, Path(args.install))
            print(f"installed: {path} (serve it with models.draft: {args.install})", flush=True)
    return 0


TUNABLE = ("unit_prompts", "unit_followups", "max_new_tokens", "self_instruct", "variants", "draft_vocab", "epochs",
           "train_seconds", "eval_prompts", "eval_held_out", "eval_max_new_tokens", "ttt_steps", "batch_size", "lr")


def report_markdown(report: dict) -> str:
    lines = [f"# EAGLE head for {report['job']['target']}", "",
             f"{report['answer_tokens']} answer tokens in {report['units']} units; best {report['best']!r}, "
             f"installed {report['installed_variant']!r}.", "",
             "| variant | set | k=3 mean accepted length | acceptance by position (k=3) | c |", "| --- | --- | ---: | --- | ---: |"]
    for variant, result in report["variants"].items():
        for name, part in result["acceptance"].items():
            k3 = part["k3"]
            by_position = " / ".join(f"{a:.2f}" for a in k3["acceptance_by_position"])
            lines.append(f"| {variant} | {name} | {k3['mean_accepted_length']:.2f} | {by_position} | "
                         f"{result['cost']['c']:.3f} |")
    return "\n".join(lines) + "\n"
