"""Grammar engines for structured outputs, side by side: xgrammar, llguidance, outlines-core.

    python -m splitspec.bench.grammars --out docs/bench/grammar/engines.json

The corpus is MaskBench (JSONSchemaBench's schemas with valid and invalid
instances, github.com/guidance-ai/jsonschemabench, maskbench/data), read from a
git snapshot. Per schema and engine: compile time; then each test instance,
``json.dumps``-ed and tokenized by the default model's tokenizer, is walked
token by token: fill the vocab bitmask, check the token's bit, consume it
(the per-token time is the fill plus the consume). A valid instance passes when
every token is allowed and the grammar accepts at the end; an invalid one
passes when some token is refused or the end is not accepting. Along the first
valid instance the walk also tries draft-tree moves: consume k tokens, roll
back k, and checks the mask is the one before.

The engines run in turn in one worker process (comparable timings); a schema
that takes one engine longer than ``--timeout`` seconds kills the worker, is
counted a timeout for that engine, and the worker restarts. An engine that is
not installed is reported missing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

DEFAULT_CORPUS = "/work/.mirror/guidance-ai+jsonschemabench/repo"
DEFAULT_TOKENIZER = Path.home() / ".cache/splitspec/models/SmolLM2-135M-Instruct"
CANDIDATES = ("xgrammar", "llguidance", "outlines-core")
ROLLBACK_K = 4  # draft tokens tried and rolled back at each probe (a typical k)
ROLLBACK_PROBES = 3  # probes along the first valid instance of each schema
TARGET_STEP_MS = 25.0  # a target step of the default model on one core (the fast end: 25-40 ms)


# -- candidates: one adapter each, behind the same five calls ----------------------------------------------


class Candidate:
    """compile(schema text) -> grammar; start(grammar) -> matcher; fill / consume / rollback / accepting."""

    package = ""

    def __init__(self, tokenizer, vocab_size: int):
        import torch

        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)  # [1, words]

    def allowed(self, token: int) -> bool:
        word = int(self.bitmask[0, token >> 5])
        return bool((word >> (token & 31)) & 1)


class XGrammar(Candidate):
    package = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        super().__init__(tokenizer, vocab_size)
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: str):  # compliant mode: any whitespace, extra properties as the schema allows
        return self.compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=False)

    def start(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def accepting(self, matcher) -> bool:
        return matcher.is_completed()


class LLGuidance(Candidate):
    package = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        super().__init__(tokenizer, vocab_size)
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.fill_bitmask = llguidance, llguidance.torch.fill_next_token_bitmask
        self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, schema: str):
        matcher = self.llg.LLMatcher(self.lltok, self.llg.LLMatcher.grammar_from_json_schema(schema), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def start(self, grammar):
        return grammar.deep_copy()

    def fill(self, matcher) -> None:
        self.fill_bitmask(matcher, self.bitmask, 0)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher, n: int) -> None:
        if not matcher.rollback(n):
            raise RuntimeError(matcher.get_error() or "rollback refused")

    def accepting(self, matcher) -> bool:
        return matcher.is_accepting()


class OutlinesCore(Candidate):
    package = "outlines-core"
    MAX_ROLLBACK = 64  # the Guide keeps this many past states (its default, 32, is less than a deep draft tree)

    def __init__(self, tokenizer, vocab_size: int):
        super().__init__(tokenizer, vocab_size)
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.to_regex = outlines_core, build_regex_from_schema
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, byte_level_vocabulary(tokenizer))

    def compile(self, schema: str):
        return self.oc.Index(self.to_regex(schema), self.vocabulary)

    def start(self, grammar):
        return self.oc.Guide(grammar, max_rollback=self.MAX_ROLLBACK)

    def fill(self, matcher) -> None:
        matcher.write_mask_into(self.bitmask.data_ptr(), self.bitmask.numel(), self.bitmask.element_size())

    def consume(self, matcher, token: int) -> bool:
        if not matcher.accepts_tokens([token]):
            return False
        matcher.advance(token, return_tokens=False)
        return True

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback_state(n)

    def accepting(self, matcher) -> bool:
        return matcher.is_finished()


ADAPTERS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def byte_level_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """Token bytes -> ids for a GPT-2 style byte-level BPE (outlines-core wants bytes; its own loader needs the Hub)."""
    to_byte = {c: b for b, c in gpt2_byte_chars().items()}
    special = set(tokenizer.all_special_ids) | {tokenizer.eos_token_id}
    vocab: dict[bytes, list[int]] = {}
    for piece, token in tokenizer.get_vocab().items():
        if token not in special and all(c in to_byte for c in piece):
            vocab.setdefault(bytes(to_byte[c] for c in piece), []).append(token)
    return vocab


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


# -- corpus ----------------------------------------------------------------------------------------------------


def load_corpus(repo: str, n_schemas: int, seed: int = 0) -> list[dict]:
    """A seeded sample of MaskBench files that have tests, read from a bare git snapshot."""
    names = subprocess.run(["git", "-C", repo, "ls-tree", "--name-only", "HEAD", "maskbench/data/"],
                           check=True, capture_output=True, text=True).stdout.split()
    random.Random(seed).shuffle(names)
    out = []
    for name in names:
        item = json.loads(subprocess.run(["git", "-C", repo, "show", f"HEAD:{name}"], check=True,
                                         capture_output=True, text=True).stdout)
        if item.get("tests"):
            out.append({"name": name.rsplit("/", 1)[-1], "schema": json.dumps(item["schema"]),
                        "tests": [(t["valid"], json.dumps(t["data"], ensure_ascii=False)) for t in item["tests"]]})
        if len(out) == n_schemas:
            break
    return out


# -- one schema on one engine ----------------------------------------------------------------------------------


def walk(engine: Candidate, grammar, tokens: list[int], times_us: list[float], *, probe_rollback: bool) -> dict:
    """Walk tokens with masks; returns whether all were allowed and the end accepts, and rollback probe results."""
    matcher = engine.start(grammar)
    probes = {len(tokens) * (i + 1) // (ROLLBACK_PROBES + 1) for i in range(ROLLBACK_PROBES if probe_rollback else 0)}
    rollback_ok = rollback_bad = 0
    for i, token in enumerate(tokens):
        if i in probes and i + ROLLBACK_K <= len(tokens):
            engine.fill(matcher)
            before = engine.bitmask.clone()
            tried = 0
            for t in tokens[i:i + ROLLBACK_K]:  # a draft path of k tokens, then the verdict rejects them all
                if not engine.consume(matcher, t):
                    break
                tried += 1
            try:
                engine.rollback(matcher, tried)
                engine.fill(matcher)
                same = bool((engine.bitmask == before).all())
            except Exception:  # noqa: BLE001 - an engine refusing the rollback is the finding
                same = False
            rollback_ok, rollback_bad = rollback_ok + same, rollback_bad + (not same)
            if not same:
                matcher = engine.start(grammar)
                for t in tokens[:i]:
                    engine.consume(matcher, t)
        t0 = time.perf_counter()
        engine.fill(matcher)
        fill_s = time.perf_counter() - t0
        if not engine.allowed(token):  # the bit check is ours, not the engine's: outside the timing
            times_us.append(fill_s * 1e6)
            return {"accepted": False, "rollback_ok": rollback_ok, "rollback_bad": rollback_bad}
        t0 = time.perf_counter()
        ok = engine.consume(matcher, token)
        times_us.append((fill_s + time.perf_counter() - t0) * 1e6)
        if not ok:
            return {"accepted": False, "rollback_ok": rollback_ok, "rollback_bad": rollback_bad}
    return {"accepted": engine.accepting(matcher), "rollback_ok": rollback_ok, "rollback_bad": rollback_bad}


def run_schema(engine: Candidate, item: dict) -> dict:
    t0 = time.perf_counter()
    try:
        grammar = engine.compile(item["schema"])
    except Exception as exc:  # noqa: BLE001 - a compile failure is a result, not a crash
        return {"compile_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    result = {"compile_ms": (time.perf_counter() - t0) * 1e3, "token_us": [], "valid_pass": 0, "valid_total": 0,
              "invalid_pass": 0, "invalid_total": 0, "rollback_ok": 0, "rollback_bad": 0}
    probed = False
    for valid, text in item["tests"]:
        tokens = engine.tokenizer.encode(text, add_special_tokens=False)
        walked = walk(engine, grammar, tokens, result["token_us"], probe_rollback=valid and not probed)
        probed = probed or valid
        key = "valid" if valid else "invalid"
        result[f"{key}_total"] += 1
        result[f"{key}_pass"] += walked["accepted"] == valid
        result["rollback_ok"] += walked["rollback_ok"]
        result["rollback_bad"] += walked["rollback_bad"]
    return result


def worker(conn, tokenizer_dir: str, vocab_size: int, names: list[str]) -> None:
    """Load the tokenizer and the engines once, then answer (engine, item) requests until told to stop."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    engines = {name: ADAPTERS[name](tokenizer, vocab_size) for name in names}
    conn.send("ready")
    while (request := conn.recv()) is not None:
        name, item = request
        conn.send(run_schema(engines[name], item))


# -- the comparison --------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """One engine's results over the corpus."""

    schemas: int = 0
    compile_errors: int = 0
    timeouts: int = 0
    schemas_all_pass: int = 0
    valid_pass: int = 0
    valid_total: int = 0
    invalid_pass: int = 0
    invalid_total: int = 0
    rollback_ok: int = 0
    rollback_bad: int = 0
    compile_ms: list = field(default_factory=list)
    token_us: list = field(default_factory=list)
    examples: list = field(default_factory=list)  # a few compile errors, timeouts and wrong answers, by schema


def installed(name: str) -> dict | None:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    size = sum((f.size or 0) for f in dist.files or [])
    requires = [r for r in dist.requires or [] if "extra ==" not in r]
    return {"version": dist.version, "license": dist.metadata.get("License-Expression") or dist.metadata.get("License"),
            "installed_mb": round(size / 1e6, 1), "requires": requires}


def percentile(values: list, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(corpus: list[dict], *, tokenizer_dir: str = str(DEFAULT_TOKENIZER), vocab_size: int | None = None,
        timeout_s: float = 30.0, names=CANDIDATES) -> dict:
    """Every available candidate on every schema of the corpus, in one worker process; the summary as plain data."""
    if vocab_size is None:
        vocab_size = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    packages = {name: installed(name) for name in names}
    present = [name for name in names if packages[name]]
    tallies = {name: Tally() for name in present}
    ctx = mp.get_context("spawn")

    def start_worker():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(child, tokenizer_dir, vocab_size, present), daemon=True)
        proc.start()
        child.close()  # the worker's end: a worker that dies shows up as EOFError here
        if parent.recv() != "ready":
            raise RuntimeError("the grammar worker did not start")
        return proc, parent

    proc, conn = start_worker()
    for item in corpus:
        for name in present:
            tally = tallies[name]
            tally.schemas += 1
            conn.send((name, item))
            if not conn.poll(timeout_s):
                proc.kill()
                proc.join()
                tally.timeouts += 1
                tally.examples.append((item["name"], f"timeout > {timeout_s:g} s"))
                proc, conn = start_worker()
                continue
            result = conn.recv()
            if "compile_error" in result:
                tally.compile_errors += 1
                tally.examples.append((item["name"], result["compile_error"]))
                continue
            tally.compile_ms.append(result["compile_ms"])
            tally.token_us += result["token_us"]
            for key in ("valid_pass", "valid_total", "invalid_pass", "invalid_total", "rollback_ok", "rollback_bad"):
                setattr(tally, key, getattr(tally, key) + result[key])
            if result["valid_pass"] == result["valid_total"] and result["invalid_pass"] == result["invalid_total"]:
                tally.schemas_all_pass += 1
            else:
                tally.examples.append((item["name"], "valid {valid_pass}/{valid_total}, invalid {invalid_pass}/"
                                                     "{invalid_total}".format(**result)))
    conn.send(None)
    proc.join(timeout=10)
    return {"corpus": "MaskBench (guidance-ai/jsonschemabench maskbench/data)", "schemas": len(corpus),
            "tokenizer": Path(tokenizer_dir).name, "vocab_size": vocab_size, "timeout_s": timeout_s,
            "target_step_ms": TARGET_STEP_MS,
            "engines": {name: summarize(tallies.get(name), packages[name]) for name in names}}


def summarize(tally: Tally | None, package: dict | None) -> dict:
    if package is None:
        return {"missing": True}
    return {"package": package, "schemas": tally.schemas, "compile_errors": tally.compile_errors,
            "timeouts": tally.timeouts, "schemas_all_pass": tally.schemas_all_pass,
            "valid_pass": tally.valid_pass, "valid_total": tally.valid_total,
            "invalid_pass": tally.invalid_pass, "invalid_total": tally.invalid_total,
            "rollback_ok": tally.rollback_ok, "rollback_bad": tally.rollback_bad,
            "compile_ms_median": percentile(tally.compile_ms, 0.5),
            "compile_ms_p99": percentile(tally.compile_ms, 0.99),
            "tokens": len(tally.token_us),
            "token_us_median": percentile(tally.token_us, 0.5), "token_us_p99": percentile(tally.token_us, 0.99),
            "token_us_mean": statistics.fmean(tally.token_us) if tally.token_us else None,
            "examples": tally.examples[:20]}


def table(report: dict) -> str:
    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    rows = [f"{report['schemas']} MaskBench schemas, tokenizer {report['tokenizer']} (vocab {report['vocab_size']}), "
            f"compile timeout {report['timeout_s']:g} s; per token = fill the bitmask + consume",
            f"{'engine':<22}{'compile err':>12}{'timeout':>8}{'compile ms p50/p99':>20}{'token us p50/p99':>18}"
            f"{'valid ok':>12}{'invalid ok':>12}{'schemas ok':>11}{'rollback':>10}"]
    for name, e in report["engines"].items():
        if e.get("missing"):
            rows.append(f"{name:<22}not installed")
            continue
        label = f"{name} {e['package']['version']}"
        rows.append(f"{label:<22}{e['compile_errors']:>12}{e['timeouts']:>8}"
                    f"{fmt(e['compile_ms_median']) + '/' + fmt(e['compile_ms_p99']):>20}"
                    f"{fmt(e['token_us_median'], '.0f') + '/' + fmt(e['token_us_p99'], '.0f'):>18}"
                    f"{e['valid_pass']:>6}/{e['valid_total']:<5}{e['invalid_pass']:>6}/{e['invalid_total']:<5}"
                    f"{e['schemas_all_pass']:>11}{e['rollback_ok']:>5}/{e['rollback_ok'] + e['rollback_bad']:<4}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the report as JSON here")
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, help="a git snapshot of guidance-ai/jsonschemabench")
    parser.add_argument("--schemas", type=int, default=120, help="how many schemas (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per schema and engine")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="a model folder (tokenizer + config.json)")
    parser.add_argument("--engines", default=",".join(CANDIDATES))
    args = parser.parse_args(argv)
    corpus = load_corpus(args.corpus, args.schemas, args.seed)
    report = run(corpus, tokenizer_dir=args.tokenizer, timeout_s=args.timeout, names=tuple(args.engines.split(",")))
    argv = sys.argv[1:] if argv is None else argv
    report["command"] = "python -m splitspec.bench.grammars " + " ".join(argv)
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
