"""Train an EAGLE head on the self-instruct data and measure it beside the model drafter.

All figures come from one process: acceptance by draft position (greedy,
along the target's own greedy answers, teacher-forced target features for
the accepted context) on the held-out and everyday sets, and the cost of one
draft token against one target decode step, both at 1 thread in the same run.

    python -m services.training.eagle_recipe --feature final --train-seconds 1800
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from services.models import eagle
from services.models.default_pair import SHIPPED_EAGLE, drafter_dir, home, target_dir
from services.training import eagle_train, selfinstruct
from services.training.acceptance import acceptance, eagle_drafts, model_drafts
from services.training.pipeline import median_ms

logger = logging.getLogger(__name__)
WEIGHTS_DIR = SHIPPED_EAGLE.parent  # services/models/eagle_weights
COST_CONTEXT = 160  # context length at which one draft token and one target step are timed
COST_REPEATS = 41  # timing repeats (median)


def load_models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir(), dtype=torch.float32).eval().requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(target_dir())


def eval_sets(target, tokenizer, data_cfg: selfinstruct.DataConfig) -> dict:
    return selfinstruct.build_eval(target, tokenizer, data_cfg, home() / "selfinstruct")


def evaluate(drafts_fn, sets: dict) -> dict:
    return {name: acceptance(drafts_fn, rows) for name, rows in sets.items()}


def coverage(kept_ids: torch.Tensor, rows: list[dict]) -> float:
    """Fraction of the target's answer tokens that the pruned draft vocabulary can propose."""
    answers = torch.cat([r["ids"][r["prompt_len"]:].long() for r in rows])
    return torch.isin(answers, kept_ids).float().mean().item()


def _median_time(fn) -> float:
    return median_ms(fn, COST_REPEATS) / 1000


def measure_costs(head: eagle.EagleHead | None, row: dict) -> dict:
    """Seconds per target decode step, per model-drafter token and per head draft token, 1 thread, same context."""
    from services.loading import load_causal_lm
    from services.runner import make_runner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ctx = row["ids"][:COST_CONTEXT].long()
    out = {}
    for name, path in (("target_step_s", target_dir()), ("model_draft_token_s", drafter_dir())):
        runner = make_runner(load_causal_lm(path))
        cache = runner.new_cache()
        runner.forward(ctx, cache, last_only=True)

        def step(runner=runner, cache=cache):
            runner.forward(ctx[-1:], cache, last_only=True)
            cache.crop(len(ctx))

        out[name] = _median_time(step)
    if head is not None:
        session = eagle.HeadSession(head)
        session.extend(eagle_train.feature_of(row, head.cfg.feature)[: len(ctx)], row["ids"][1 : len(ctx) + 1])

        def draft_step():
            session.draft_one()
            session.rollback()

        out["head_draft_token_s"] = _median_time(draft_step)
        out["c_head"] = out["head_draft_token_s"] / out["target_step_s"]
    out["c_model"] = out["model_draft_token_s"] / out["target_step_s"]
    torch.set_num_threads(threads)
    return {k: round(v * 1000, 3) if k.endswith("_s") else round(v, 4) for k, v in out.items()}


def save_head(head: eagle.EagleHead, report: dict, name: str, folder: Path = WEIGHTS_DIR) -> Path:
    folder.mkdir(exist_ok=True)
    path = eagle.save_head(head, folder / f"{name}.safetensors")
    (folder / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    return path


load_head = eagle.load_head


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feature", choices=["final", "fused"], default="final")
    parser.add_argument("--draft-vocab", type=int, default=16384)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--train-seconds", type=float, default=None, help="stop training after this long")
    parser.add_argument("--max-shards", type=int, default=None, help="train on the first shards only (data-size curve)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads while training (costs are timed at 1)")
    parser.add_argument("--init", type=Path, default=None,
                        help="warm start from a saved head (its kept ids and weights), e.g. the shipped eagle-final.safetensors")
    parser.add_argument("--compare-model", action="store_true", help="also measure the shipped model drafter")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = eagle.EagleConfig(feature=args.feature, draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps,
                            epochs=args.epochs, lr=args.lr, num_threads=args.threads)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.num_threads)
    data_cfg = selfinstruct.DataConfig()
    target, tokenizer = load_models()
    data = selfinstruct.load(home() / "selfinstruct", data_cfg, max_shards=args.max_shards)
    sets = eval_sets(target, tokenizer, data_cfg)
    rows = data["rows"]
    logger.info("training data: %s", data["report"])
    if args.init is not None:  # same kept ids and weights; this run's schedule
        head = load_head(target, args.init).requires_grad_(True)
        head.cfg = cfg
        head.train()
    else:
        kept = eagle_train.kept_vocabulary(rows, cfg.draft_vocab, target.config.vocab_size)
        head = eagle.EagleHead(target, cfg, kept, rows[0][cfg.feature].shape[-1])
    t0 = time.perf_counter()
    ckpt = home() / "selfinstruct" / f"eagle-{cfg.feature}-checkpoint.pt"
    log = eagle_train.train(head, rows, cfg, data_cfg.teacher_top_k, max_seconds=args.train_seconds,
                      checkpoint=lambda step: torch.save(head.trainable_state(), ckpt))
    train_s = time.perf_counter() - t0
    head.eval()
    report = {
        "config": asdict(cfg), "init": str(args.init.name) if args.init else None,
        "data": data["report"], "train_seconds": round(train_s, 1),
        "steps": len(log), "final_loss": log[-1],
        "parameters": sum(p.numel() for p in head.parameters()),
        "acceptance": evaluate(lambda r, s: eagle_drafts(head, r, s), sets),
        "kept_vocab_coverage": {name: round(coverage(head.kept_ids, rows), 4) for name, rows in sets.items()},
    }
    if args.compare_model:
        from transformers import AutoModelForCausalLM

        drafter = AutoModelForCausalLM.from_pretrained(drafter_dir(), dtype=torch.float32).eval()
        report["model_drafter_acceptance"] = evaluate(lambda r, s: model_drafts(drafter, r, s), sets)
        report["target_as_drafter_k3"] = evaluate(lambda r, s: model_drafts(target, r, s), {"held_out": sets["held_out"][:8]})
    report["costs_ms"] = measure_costs(head, max(sets["held_out"], key=lambda r: len(r["ids"])))
    name = args.name or f"eagle-{cfg.feature}"
    path = save_head(head, report, name)
    logger.info("saved %s", path)
    print(json.dumps({k: v for k, v in report.items() if k != "data"}, indent=2))


if __name__ == "__main__":
    main()
