"""Acceptance of the 4-layer model drafter against the amount of self-instruct data it has seen.

One seeded pass of ``distill.distil`` over the self-instruct shards (the
target's greedy answers and top-K), measuring greedy acceptance by draft
position on the held-out and everyday sets (``acceptance.acceptance``, the same
walk as the EAGLE head) every ``--eval-every`` optimiser steps:

    python -m services.training.drafter_curve --init target --epochs 1 --eval-every 100
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from services.models.default_pair import home, truncated_student
from services.training import distill, selfinstruct
from services.training.acceptance import acceptance, model_drafts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", choices=["target", "shipped"], default="target")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-shards", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("drafter_curve.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = distill.DistillConfig(data=distill.SELFINSTRUCT_DATA, max_shards=args.max_shards, init=args.init,
                                epochs=args.epochs, lr=args.lr, num_threads=1)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.num_threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.models.default_pair import target_dir

    target = AutoModelForCausalLM.from_pretrained(target_dir(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    data_cfg = selfinstruct.DataConfig()
    loaded = selfinstruct.load(home() / "selfinstruct", data_cfg, max_shards=cfg.max_shards)
    data = selfinstruct.to_distill_data(loaded["rows"])
    sets = selfinstruct.build_eval(target, tokenizer, data_cfg, home() / "selfinstruct")
    tokens_per_step = sum(int(m.sum()) for m in data["masks"]) / len(data["masks"]) * cfg.batch_size
    student = truncated_student(target, cfg.num_layers)
    if cfg.init == "shipped":
        student.load_state_dict(distill.shipped_state(), strict=False)
    points = []

    def measure(step, model):
        result = {name: {k: v for k, v in acceptance(lambda r, s: model_drafts(model, r, s), rows, ks=(1, 3)).items()}
                  for name, rows in sets.items()}
        points.append({"step": step, "answer_tokens_seen": round(step * tokens_per_step), "acceptance": result})
        logging.info("step %d (~%d tokens seen): held-out k3 %s, everyday k3 %s", step, points[-1]["answer_tokens_seen"],
                     result["held_out"]["k3"]["acceptance_rate"], result["everyday"]["k3"]["acceptance_rate"])
        args.out.write_text(json.dumps({"config": asdict(cfg), "data": loaded["report"], "points": points}, indent=2) + "\n")

    measure(0, student.eval())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    losses = distill.distil(student, data, cfg, pad, callback=measure, callback_every=args.eval_every)
    measure(len(losses), student)
    logging.info("trained %d steps in %.0f s, final loss %.3f", len(losses), time.perf_counter() - start, losses[-1])


if __name__ == "__main__":
    main()
