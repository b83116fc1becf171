"""splitspec served on a GPU through Ray Serve, in one command: `scripts/gpu-serve-check.sh` (`--device cpu` runs
the same on the CPU).

It builds a random-weight pair around a real tokenizer (the default target's architecture with random weights,
its embeddings scaled so that the two best logits seldom nearly tie; a drafter made of the target's first layers,
so that it agrees with the target part of the time), then, twice, starts `splitspec serve` on a local one-node
Ray cluster and asks it through gRPC:

1. ``configs/gpu-one.yaml`` as it is: prefill, draft and verify on the one GPU (a fraction each), bfloat16, the
   drafter colocated in the verify replica;
2. mixed devices: the draft stage on the CPU (float32, not colocated: every draft crosses from a CPU replica to
   the GPU verifier), prefill and verify on the GPU.

Each run passes when the service deploys; every greedy answer (draft model k = 1 and 3, the server's adaptive
default, streamed, and four requests at once) is speculation off's token for token; a seeded sampled request
gives the same answer twice; and `splitspec serve` stops on SIGTERM within its bound. It reports tokens/s,
acceptance and the prefill → verify KV handoff (Timings.kv_handoff_ms). Prints SKIP and exits 0 where a cuda run
is asked for and torch sees no GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml

from services.models.tiny import TOKENIZER_FILES, random_pair
from splitspec.checks.gpu import first_difference

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "gpu-one.yaml"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
           "Count from 1 to 10."]
POLICIES = {"model k=1": dict(drafter="model", num_draft_tokens=1),
            "model k=3": dict(drafter="model", num_draft_tokens=3),
            "server default": dict()}
DRAFT_CPU_THREADS = 4  # the mixed run's CPU drafter beside a GPU (a GPU machine has cores to spare)
RUNS = ("one-gpu", "mixed")
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 120  # a request that hangs fails its check within this (the run then stops its server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitspec.checks.gpu_serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the same runs on the CPU")
    parser.add_argument("--tokenizer", type=Path, help="a folder with the default pair's tokenizer files (default: "
                        "the prepared default target's)")
    parser.add_argument("--shape", choices=["default", "small"],
                        help="the target's architecture: the default target's (default on cuda) or a small one "
                        "(default on the CPU)")
    parser.add_argument("--runs", type=_runs, default=list(RUNS), help=f"comma separated, of {', '.join(RUNS)}")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", help="also write the results as JSON here (after each run)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"SKIP: torch {torch.__version__} sees no CUDA GPU on this machine; nothing was served "
              "(--device cpu runs the same on the CPU)")
        return 0
    shape = args.shape or ("default" if args.device == "cuda" else "small")
    tokenizer = args.tokenizer or _prepared_tokenizer()
    missing = [f for f in TOKENIZER_FILES if not (tokenizer / f).is_file()]
    if missing:
        print(f"error: {tokenizer} lacks {missing}: prepare the default pair (splitspec models prepare) or pass "
              "--tokenizer", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    print(f"device {args.device} (GPU: {gpu}), torch {torch.__version__}, {_versions()}, shape {shape}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="splitspec-serve-check-") as tmp:
        pair = random_pair(Path(tmp), tokenizer, shape)
        for run in args.runs:
            path = Path(tmp) / f"{run}.yaml"
            path.write_text(yaml.safe_dump(run_config(run, pair, args.device)))
            results.append(serve_and_check(run, path, args.max_new_tokens, _run_env(run, args.device)))
            if args.json:  # after each run: a check cut short by its caller keeps what it has
                Path(args.json).write_text(json.dumps({"device": args.device, "gpu": gpu, "shape": shape,
                                                       "runs": results}, indent=2))
            if _TERMINATED.is_set():
                return 128 + signal.SIGTERM
    checks = [c for r in results for c in r["checks"]]
    failed = [c for c in checks if not c["ok"]]
    print(f"{len(checks) - len(failed)}/{len(checks)} serve checks passed", flush=True)
    return 1 if failed else 0


def _runs(text: str) -> list[str]:
    """--runs: the named runs, each one of RUNS."""
    runs = [run.strip() for run in text.split(",") if run.strip()]
    unknown = [run for run in runs if run not in RUNS]
    if unknown or not runs:
        raise argparse.ArgumentTypeError(f"runs are {', '.join(RUNS)}; got {text!r}")
    return runs


def _versions() -> str:
    """The versions the service runs on (Ray from the carried bundle where the machine has none)."""
    import ray
    import transformers

    return f"transformers {transformers.__version__}, ray {ray.__version__}"


def _prepared_tokenizer() -> Path:
    """The prepared default target's folder (its tokenizer files)."""
    from services.models import default_pair

    return default_pair.target_dir()


def run_config(run: str, pair: tuple[Path, Path], device: str) -> dict:
    """configs/gpu-one.yaml's app args for ``run`` (one of RUNS) with the random pair (on the CPU: every cuda stage
    on the CPU)."""
    data = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    data["models"].update(target=str(pair[0]), draft=str(pair[1]))
    data["limits"].update(max_new_tokens=256)
    stages = data["stages"]
    if run == "mixed":
        stages["draft"].update(device="cpu", dtype="float32", threads=DRAFT_CPU_THREADS if device == "cuda" else 1)
        stages["draft"]["placement"]["num_gpus"] = 0
        data["speculation"] = {"drafting": "remote"}  # (the draft stage on the CPU: a device of its own)
    if device == "cpu":
        for stage in stages.values():
            stage["device"] = "cpu"
            stage["placement"]["num_gpus"] = 0
        stages["verify"]["kv_capacity"] = 512  # every bfloat16 pass on the CPU attends over the whole buffer
    return data


def _run_env(run: str, device: str) -> dict[str, str]:
    """More environment for the run's server: on a GPU machine the mixed run's CPU drafter skips building the CPU
    kernels (a minute on a fresh machine, inside the check's time bound; its drafts are verified either way)."""
    return {"SPLITSPEC_NO_KERNELS": "1"} if run == "mixed" and device == "cuda" else {}


def serve_and_check(run: str, config: Path, max_new_tokens: int, env: dict[str, str] | None = None) -> dict:
    """Start `splitspec serve --config config` (on free ports), run the checks through gRPC, stop it; the run's
    results: {"run", "checks": [{"name", "ok", "detail"}], and figures per policy}."""
    from splitspec.api.client import SpecDecodeClient
    from splitspec.cluster import free_port

    print(f"== {run}: splitspec serve --config {config.name} ({_stages(config)})", flush=True)
    report: dict = {"run": run, "checks": []}

    def check(name: str, ok: bool, detail: str) -> None:
        report["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'} {run}: {name}: {detail}", flush=True)

    started = time.monotonic()
    grpc_port = free_port()
    server = _Server(config, grpc_port, free_port(), env or {})
    try:
        up = server.wait_serving(START_TIMEOUT_S)
        check("deploy", up, f"serving after {time.monotonic() - started:.0f} s" if up else
              f"not serving (exit code {server.proc.poll()}); its log's end:\n{server.tail()}")
        if up:
            with SpecDecodeClient(f"127.0.0.1:{grpc_port}", timeout_s=REQUEST_TIMEOUT_S) as client:
                ask = _Asker(client, max_new_tokens)
                want = _greedy_checks(ask, check, report)
                _at_once_check(ask, want, check)
                _stream_check(ask, want, check)
                _sampled_check(ask, check)
    except Exception as exc:  # noqa: BLE001 - reported as a failed check; the server is stopped below
        check("requests", False, f"{type(exc).__name__}: {exc}")
    finally:
        code, seconds = server.stop(STOP_TIMEOUT_S)
        check("stop", code == 0 and seconds <= STOP_TIMEOUT_S, f"exit code {code} after {seconds:.1f} s (SIGTERM)")
    return report


def _stages(config: Path) -> str:
    """'prefill cuda, draft cpu, ...' of a run's config file."""
    stages = yaml.safe_load(config.read_text())["stages"]
    return ", ".join(f"{name} {s['device']}" for name, s in stages.items())


class _Asker:
    """Chat requests of one user turn to the service, greedy unless told otherwise."""

    def __init__(self, client, max_new_tokens: int):
        self.client, self.max_new_tokens = client, max_new_tokens

    def __call__(self, prompt: str, **policy):
        return self.client.generate(messages=[("user", prompt)], max_new_tokens=self.max_new_tokens, **policy)

    def stream(self, prompt: str, **policy) -> list[int]:
        return [t for chunk in self.client.stream(messages=[("user", prompt)], max_new_tokens=self.max_new_tokens,
                                                  **policy) for t in chunk.token_ids]


def _greedy_checks(ask: _Asker, check, report: dict) -> dict[str, list[int]]:
    """Each policy's greedy answers against speculation off's, one request at a time; speculation off's answers."""
    off = {p: ask(p, speculate=False) for p in PROMPTS}
    report["speculation off"] = _figures(off.values())
    want = {p: list(r.token_ids) for p, r in off.items()}
    for name, policy in POLICIES.items():
        got = {p: ask(p, **policy) for p in PROMPTS}
        moved = {p: i for p, r in got.items() if (i := first_difference(list(r.token_ids), want[p])) is not None}
        figures = report[name] = _figures(got.values())
        check(f"greedy {name} = speculation off", not moved,
              f"{len(PROMPTS)} prompts; {figures['tokens_per_s']:.1f} tok/s (off "
              f"{report['speculation off']['tokens_per_s']:.1f}), accepted {figures['accepted']}/{figures['drafted']}, "
              f"KV handoff {figures['kv_handoff_ms']:.1f} ms" + (f"; differs at token {moved}" if moved else ""))
    return want


def _at_once_check(ask: _Asker, want: dict[str, list[int]], check) -> None:
    """All prompts at once (their verify steps share passes): each answer still speculation off's."""
    pool = concurrent.futures.ThreadPoolExecutor(len(PROMPTS))
    try:
        answers = list(pool.map(lambda p: list(ask(p, **POLICIES["model k=3"]).token_ids), PROMPTS))
    finally:  # on a stop (SIGTERM) do not wait for the requests: the server's stop ends them
        pool.shutdown(wait=False, cancel_futures=True)
    differ = [p for p, answer in zip(PROMPTS, answers) if answer != want[p]]
    check(f"greedy k=3, {len(PROMPTS)} requests at once = speculation off", not differ,
          f"{len(PROMPTS)} requests" + (f"; differ: {differ}" if differ else ""))


def _stream_check(ask: _Asker, want: dict[str, list[int]], check) -> None:
    streamed = ask.stream(PROMPTS[0], **POLICIES["model k=3"])
    check("streamed k=3 = speculation off", streamed == want[PROMPTS[0]], f"{len(streamed)} tokens")


def _sampled_check(ask: _Asker, check) -> None:
    sampled = [list(ask(PROMPTS[1], temperature=0.8, seed=7, **POLICIES["model k=3"]).token_ids) for _ in range(2)]
    check("seeded sampled k=3 repeats", sampled[0] == sampled[1] and len(sampled[0]) > 0, f"{len(sampled[0])} tokens")


def _figures(responses) -> dict:
    """Tokens, tokens/s (server-side time), drafted and accepted tokens, mean KV handoff of some responses."""
    responses = list(responses)
    tokens = sum(len(r.token_ids) for r in responses)
    seconds = sum(r.timings.total_ms for r in responses) / 1e3
    return {"tokens": tokens, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "drafted": sum(r.speculation_stats.drafted for r in responses),
            "accepted": sum(r.speculation_stats.accepted for r in responses),
            "kv_handoff_ms": sum(r.timings.kv_handoff_ms for r in responses) / len(responses)}


class _Server:
    """`splitspec serve` as a child process in its own session, its output kept for the report."""

    def __init__(self, config: Path, grpc_port: int, http_port: int, env: dict[str, str]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1", **env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitspec.cli", "serve", "--config", str(config), "--grpc-port", str(grpc_port),
             "--http-port", str(http_port), "--no-dashboard", "--stop-timeout", str(STOP_TIMEOUT_S - 10)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.serving = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "splitspec is serving" in line:
                self.serving.set()

    def wait_serving(self, timeout_s: float) -> bool:
        """Whether it says it serves within ``timeout_s`` (False at once if it exits)."""
        deadline = time.monotonic() + timeout_s
        while not self.serving.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
        return True

    def tail(self, lines: int = 30) -> str:
        return "".join(self.lines[-lines:])

    def stop(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM, then its exit code and the seconds it took (its whole session killed past ``timeout_s``)."""
        start = time.monotonic()
        _STOPPING.set()  # a SIGTERM of ours now lets this stop finish (_on_sigterm)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        finally:
            _STOPPING.clear()
        return code, time.monotonic() - start


_STOPPING = threading.Event()  # a server's stop is under way
_TERMINATED = threading.Event()  # a SIGTERM came: no further run


def _on_sigterm(*_) -> None:
    """A SIGTERM (e.g. `timeout`, which sends it twice: to us and to our group) unwinds once, so that the server
    started here is stopped (it runs in its own session); later ones are ignored. One that comes while a server
    stops lets that stop finish; then no further run starts."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _TERMINATED.set()
    if not _STOPPING.is_set():
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main())
