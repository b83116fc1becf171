"""The engine on one device, checked in one command: ``python -m splitspec.checks.gpu`` (scripts/gpu-check.sh).

No Ray, no gRPC: only services/ with torch and transformers, so that it runs
on a bare GPU machine. On the chosen device (default cuda; skipped with a
message, exit 0, where torch sees no GPU):

0. batch invariance, float32 and bfloat16, the tiny pair's target and the
   default target's shape (random weights): the verifier's logits for a block
   of tokens are the same bits whether the block is scored in one pass, in
   two, or one token at a time (what greedy exactness rests on; the plain
   transformers' forward is measured beside it);
1. tiny pair: greedy speculative output (draft model k = 1 and 3) is
   token-identical to the target alone (the engine, speculation off), which
   is compared with transformers' ``generate`` on the same device as well;
2. KV round trip, float32 and bfloat16: device -> payload (host numpy) ->
   device, and the next logits equal those of the cache it came from;
3. rollback, float32 and bfloat16: a cache cropped after a rejected draft
   equals a fresh forward (up to the dtype's rounding, same argmax);
4. sampled chi-square on the tiny pair: the first verified token follows the
   target's p when a random draft distribution q proposes it;
5. tokens/s, target alone vs speculative (the default pair when it is
   prepared in this machine's cache, else the tiny pair), each speculative
   answer identical to speculation off;
6. batched verify: concurrent sessions' verify blocks in one pass of the
   batch-invariant verifier (its slots) against one session a pass, in
   session-steps/s (the default target's shape on a GPU, the tiny one on the
   CPU; bfloat16);
7. the KV handoff of the default target's architecture (random weights: the
   size of the KV depends on the shape alone): export (device -> host numpy,
   what prefill puts in the object store), import (host -> device, what the
   verifier does), and a device-to-device copy of the same tensors, the
   floor of a GPU-native transport; and the verifier's import into its
   static buffer (services.batch_invariant).

Exit code 0 when every check passes (or the device is absent), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

TINY_PROMPTS = [[1, 5, 7, 9, 11], [1, 20], [1, 30, 31, 32, 30, 31], [1, 40, 41, 42, 43, 44, 45, 46]]
NEW_TOKENS = 48
KV_DTYPES = ("float32", "bfloat16")  # the KV round trip and the rollback run in each
ROLLBACK_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # relative to the largest logit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitspec-gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (the same checks on the CPU)")
    parser.add_argument("--dtype", default="", help="dtype of the default-pair speed check (default: bfloat16 on cuda)")
    parser.add_argument("--draws", type=int, default=3000, help="samples of the chi-square check")
    parser.add_argument("--pair", choices=["auto", "tiny", "default"], default="auto",
                        help="model pair of the speed check (auto: the default pair when it is prepared here)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"SKIP: torch {torch.__version__} sees no CUDA GPU on this machine; nothing was checked "
              "(run this where a GPU is, or --device cpu for the same checks on the CPU)")
        return 0
    device = torch.device(args.device)
    torch.manual_seed(0)
    report = {"device": str(device), "torch": torch.__version__, "checks": {}}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    print(f"splitspec engine check on {report.get('gpu', device)} (torch {torch.__version__})", flush=True)
    checks = [("batch invariance", _batch_invariance), ("greedy identity (tiny pair)", _greedy_identity),
              ("KV round trip", _kv_round_trip),
              ("rollback", _rollback), ("sampled chi-square (tiny pair)", lambda d: _chi_square(d, args.draws)),
              ("tokens/s", lambda d: _speed(d, args.dtype, args.pair)), ("batched verify", _batched_verify),
              ("KV handoff", _handoff)]
    failed = 0
    for name, check in checks:
        start = time.perf_counter()
        try:
            detail = check(device)
            ok = True
        except AssertionError as exc:
            detail, ok = f"FAILED: {exc}", False
        except Exception as exc:  # a check that breaks is reported; the others still run (one GPU run counts)
            detail, ok = f"FAILED: {type(exc).__name__}: {exc}", False
        failed += not ok
        report["checks"][name] = {"ok": ok, "detail": detail, "seconds": round(time.perf_counter() - start, 1)}
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - start:.1f}s): {detail}", flush=True)
        if args.json:  # after each check: a run cut short keeps what it has
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{len(checks) - failed}/{len(checks)} checks passed on {report.get('gpu', device)}")
    return 1 if failed else 0


def _tiny(device: torch.device, dtype: str = "float32"):
    from services.loading import wrap_model
    from services.models.tiny import tiny_pair

    target, draft = tiny_pair()
    return tuple(wrap_model(m.model.to(getattr(torch, dtype)), model_id=m.model_id, dtype=dtype, device=str(device))
                 for m in (target, draft))


def _engines(target, draft):
    from services.draft import DraftEngine
    from services.prefill import PrefillEngine
    from services.verify import VerifyEngine

    return PrefillEngine(target), DraftEngine(draft), VerifyEngine(target)


def _reference(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


BLOCK = [31, 37, 41, 43, 47]  # tokens scored after TINY_PROMPTS[0], in passes of several sizes
SPLITS = ([5], [2, 3], [4, 1])


def _opened(runner, prompt: list[int]):
    """A new cache of ``runner`` holding ``prompt``."""
    cache = runner.new_cache()
    runner.forward(torch.tensor(prompt), cache)
    return cache


def _block_logits(runner, splits: list[int]) -> torch.Tensor:  # [len(BLOCK), V]
    cache = _opened(runner, TINY_PROMPTS[0])
    out, at = [], 0
    for n in splits:
        out.append(runner.forward(torch.tensor(BLOCK[at : at + n]), cache))
        at += n
    return torch.cat(out)


def _batch_invariance(device) -> str:
    from services.batch_invariant import BatchInvariantRunner
    from services.hf_runner import ModelRunner
    from services.verify import VerifyEngine

    found = []
    models = [(f"tiny {dtype}", lambda dtype=dtype: _tiny(device, dtype)[0]) for dtype in KV_DTYPES]
    models += [(f"default shape {dtype}", lambda dtype=dtype: _default_shape(device, dtype)) for dtype in KV_DTYPES]
    for name, load in models:
        target = load()
        runner = VerifyEngine(target).runner
        steps = _block_logits(runner, [1] * len(BLOCK))
        for splits in SPLITS:
            got = _block_logits(runner, splits)
            assert torch.equal(got, steps), (f"{name}, {type(runner).__name__}: passes of {splits} differ from one-row "
                                             f"steps by {float((got - steps).abs().max()):.3g}")
        shared = None
        if isinstance(runner, BatchInvariantRunner):  # its own slots; three where it has one (the CPU's default)
            shared = runner if runner.slots > 1 else BatchInvariantRunner(target, slots=3)
            _check_shared_pass(shared, name)
        plain = ModelRunner(target)
        drift = max(float((_block_logits(plain, s) - _block_logits(plain, [1] * len(BLOCK))).abs().max()) for s in SPLITS)
        slots = f", {shared.slots} sessions a pass" if shared is not None else ""
        found.append(f"{name}: {type(runner).__name__}{slots} equal bits (plain transformers' forward: rows differ by "
                     f"up to {drift:.3g})")
    return (f"a {len(BLOCK)}-token block in passes of {', '.join(map(str, SPLITS))} vs one row at a time, and beside "
            "other sessions in one pass; " + "; ".join(found))


def _check_shared_pass(runner, name: str) -> None:
    """Sessions sharing a pass (``BatchInvariantRunner`` slots) get the bits each gets beside empty slots."""
    prompts = [TINY_PROMPTS[0], TINY_PROMPTS[1], TINY_PROMPTS[2]]
    chunks = [torch.tensor(BLOCK), torch.tensor(BLOCK[:2]), torch.tensor(BLOCK[1:])]
    alone = [runner.forward(chunk, _opened(runner, prompt)) for prompt, chunk in zip(prompts, chunks)]
    shared, _ = runner.forward_batch([(chunk, _opened(runner, prompt)) for prompt, chunk in zip(prompts, chunks)])
    for i, (got, want) in enumerate(zip(shared, alone)):
        assert torch.equal(got, want), (f"{name}: session {i} in a shared pass differs from alone by "
                                         f"{float((got - want).abs().max()):.3g}")


def _greedy_identity(device) -> str:
    from services.loop import generate
    from services.sampling import SamplingParams

    target, draft = _tiny(device)
    prefill, drafts, verify = _engines(target, draft)
    accepted, agree = 0, 0
    for prompt in TINY_PROMPTS:
        alone = generate(prefill, None, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=1,
                         params=SamplingParams()).token_ids
        for k in (1, 3):
            result = generate(prefill, drafts, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                              params=SamplingParams())
            assert result.token_ids == alone, f"prompt {prompt}, k={k}: {result.token_ids[:8]}... != {alone[:8]}..."
            accepted += result.stats.accepted
        agree += alone == _reference(target.model, prompt, NEW_TOKENS)
    assert accepted > 0, "no draft token was accepted"
    return (f"{len(TINY_PROMPTS)} prompts x (k=1, k=3) identical to the target alone; {accepted} drafts accepted; "
            f"the target alone equals generate() on {agree} of {len(TINY_PROMPTS)}")


def _kv_round_trip(device) -> str:
    from services.runner import make_runner

    sizes = []
    for dtype in KV_DTYPES:
        target, _ = _tiny(device, dtype)
        # the prefill's runner and the verifier's (its KV in a static buffer)
        for runner in (make_runner(target), make_runner(target, batch_invariant=True)):
            prompt = TINY_PROMPTS[2]
            cache = runner.new_cache()
            runner.forward(torch.tensor(prompt), cache)
            payload = cache.export(target.fingerprint)
            assert payload.dtype == dtype, f"a {dtype} cache was exported as {payload.dtype}"
            imported = runner.import_payload(payload)
            nxt = torch.tensor([7])
            a, b = runner.forward(nxt, cache), runner.forward(nxt, imported)
            assert torch.equal(a, b), (f"{dtype}, {type(runner).__name__}: logits differ by "
                                       f"{float((a - b).abs().max()):.3g} after the round trip")
        sizes.append(f"{payload.nbytes} B of {dtype}")
    return f"KV out to the host and back ({', '.join(sizes)}), prefill's and verifier's runners; next logits equal"


def _rollback(device) -> str:
    from services.runner import make_runner

    worst = {}
    for dtype in KV_DTYPES:
        target, _ = _tiny(device, dtype)
        for runner in (make_runner(target), make_runner(target, batch_invariant=True)):
            prompt, accepted, rejected = TINY_PROMPTS[0], [12, 13], [14, 15, 16]
            cache = runner.new_cache()
            runner.forward(torch.tensor(prompt + accepted + rejected), cache)
            cache.crop(len(prompt) + len(accepted))
            fresh = runner.new_cache()
            runner.forward(torch.tensor(prompt + accepted), fresh)
            a, b = runner.forward(torch.tensor([17]), cache), runner.forward(torch.tensor([17]), fresh)
            name = f"{dtype}, {type(runner).__name__}"
            if getattr(runner, "rows", 0) > len(prompt + accepted + rejected):  # both chunks were padded to one shape
                assert torch.equal(a, b), f"{name}: logits differ by {float((a - b).abs().max()):.3g} after the rollback"
            # otherwise the cropped KV was computed in a longer chunk than the fresh one: equal up to the rounding
            rel = float((a - b).abs().max() / a.abs().max())
            assert rel <= ROLLBACK_TOLERANCE[dtype], f"{name}: logits differ by {rel:.3g} of their largest"
            assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{name}: the argmax moved after the rollback"
            worst[name] = rel
    return ("a cache cropped after rejected drafts gives the logits of a fresh forward ("
            + ", ".join(f"{name}: within {rel:.1g} of the largest" for name, rel in worst.items()) + ")")


def _chi_square(device, draws: int) -> str:
    from services.prefill import PrefillEngine
    from services.sampling import SamplingParams, logits_to_probs
    from services.verify import VerifyEngine
    from splitspec.checks.chi_square import chi_square, threshold

    target, _ = _tiny(device)
    verify = VerifyEngine(target)
    prompt, first = TINY_PROMPTS[3][:5], 44
    params = SamplingParams(temperature=1.0)
    payload = PrefillEngine(target).prefill(prompt, params).payload
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt + [first]], device=target.model.device)).logits[0, -1:]
    p = logits_to_probs(logits.float().cpu(), params)[0]  # [V]
    vocab = p.shape[0]
    q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(1)), -1)  # [V] a foreign draft q
    counts = torch.zeros(vocab)
    picker = torch.Generator().manual_seed(2)
    for seed in range(draws):
        verify.open("chi", payload, first, SamplingParams(temperature=1.0, seed=seed))
        x = int(torch.multinomial(q, 1, generator=picker))
        verdict = verify.verify("chi", [x], q[None])
        counts[verdict.token_ids[0]] += 1
        verify.close("chi")
    assert counts[p == 0].sum() == 0, "sampled a token of probability zero"
    stat, df = chi_square(counts, p)
    assert df >= 1, "the target's distribution is too concentrated for a chi-square test"
    assert stat < threshold(df), f"chi2 = {stat:.1f} over {df} dof (threshold {threshold(df):.1f})"
    return f"{draws} draws: chi2 = {stat:.1f} over {df} dof (threshold {threshold(df):.1f})"


def _speed(device, dtype: str, pair: str) -> str:
    from services.loading import load_causal_lm
    from services.loop import generate
    from services.models import default_pair
    from services.sampling import SamplingParams
    from services.text import chat_ids

    dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
    target_dir, draft_dir = default_pair.target_dir(), default_pair.drafter_dir()
    prepared = (target_dir / "config.json").is_file() and (draft_dir / "config.json").is_file()
    assert prepared or pair != "default", f"the default pair is not prepared in {target_dir.parent}"
    if prepared and pair != "tiny":
        target = load_causal_lm(target_dir, dtype=dtype, device=str(device))
        draft = load_causal_lm(draft_dir, dtype=dtype, device=str(device))
        prompts = [chat_ids(target.tokenizer, text) for text in
                   ("Explain what a hash map is.", "Write a short poem about the sea.", "List three uses of Python.")]
        pair, n = f"default pair ({dtype})", 64
    else:
        target, draft = _tiny(device)
        pair = "tiny pair" if pair == "tiny" else "tiny pair (the default pair is not prepared here)"
        prompts, n = TINY_PROMPTS, NEW_TOKENS
    prefill, drafts, verify = _engines(target, draft)
    rates, expected = {}, None
    _reference(target.model, prompts[0], 4)  # warm up
    generate(prefill, drafts, verify, prompts[0], max_new_tokens=4, num_draft_tokens=2, params=SamplingParams())
    answers = {}
    for name, engine, k in (("target alone (generate)", None, 0), ("speculation off", None, 1),
                            ("speculative k=2", drafts, 2), ("speculative k=4", drafts, 4)):
        outputs, start = [], time.perf_counter()
        for prompt in prompts:
            if k == 0:
                outputs.append(_reference(target.model, prompt, n))
            else:
                outputs.append(generate(prefill, engine, verify, prompt, max_new_tokens=n, num_draft_tokens=k,
                                        params=SamplingParams()).token_ids)
        _sync(device)
        rates[name] = sum(map(len, outputs)) / (time.perf_counter() - start)
        answers[name] = outputs  # compared outside the timed loop
    expected = answers["speculation off"]  # the target alone, in the engine
    for name in ("speculative k=2", "speculative k=4"):
        assert answers[name] == expected, f"{name}: output differs from speculation off ({_first_difference(answers[name], expected)})"
    generated = answers["target alone (generate)"]
    versus = "generate() gives the same tokens" if generated == expected else \
        f"generate() differs from the engine's target alone ({_first_difference(generated, expected)}: rounding of another kernel path)"
    base = rates["target alone (generate)"]
    return f"{pair}: " + ", ".join(f"{name} {r:.1f} tok/s ({r / base:.2f}x)" for name, r in rates.items()) + f"; {versus}"


BATCHED_SESSIONS = {"cuda": 8, "cpu": 3}
BATCHED_STEPS = 16


def _batched_verify(device) -> str:
    from services.batch_invariant import BatchInvariantRunner

    cuda = device.type == "cuda"
    target = _default_shape(device, "bfloat16") if cuda else _tiny(device, "bfloat16")[0]
    sessions = BATCHED_SESSIONS[device.type]
    ids = min(200, target.vocab_size)
    prompt, block = torch.randint(1, ids, (64,)), torch.randint(1, ids, (4,))  # pending + 3 drafts
    rates = {}
    for slots in (1, sessions):
        runner = BatchInvariantRunner(target, slots=slots)
        caches = [runner.new_cache() for _ in range(sessions)]
        for cache in caches:
            runner.forward(prompt, cache, last_only=True)

        def step():
            runner.forward_batch([(block, cache) for cache in caches], greedy=[True] * sessions)
            for cache in caches:
                cache.crop(cache.seq_len - 3)  # the drafts rejected: one token a step

        rates[slots] = sessions / _timed(device, step, BATCHED_STEPS)
    one, shared = rates[1], rates[sessions]
    return (f"{sessions} sessions x {BATCHED_STEPS} verify blocks of 4 rows ({target.model_id}, kv_capacity "
            f"{target.max_context}): one session a pass {one:.0f} session-steps/s, {sessions} a pass {shared:.0f} "
            f"({shared / one:.2f}x)")


HANDOFF_TOKENS = {"cuda": (512, 2048), "cpu": (128,)}  # prompt lengths whose KV is handed off
HANDOFF_REPEATS = 5


def _handoff(device) -> str:
    from services.runner import make_runner

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    loaded = _default_shape(device, dtype)
    config = loaded.config
    runner = make_runner(loaded)
    verifier = make_runner(loaded, batch_invariant=True)  # the verifier's runner: its KV in a static buffer
    rows = []
    for n in HANDOFF_TOKENS[device.type]:
        cache = runner.new_cache()
        runner.forward(torch.randint(0, config.vocab_size, (n,)), cache, last_only=True)
        payload = cache.export(loaded.fingerprint)
        timings = {"export": lambda: cache.export(loaded.fingerprint), "import": lambda: runner.import_payload(payload),
                   "verifier import": lambda: verifier.import_payload(payload)}
        if device.type == "cuda":
            kv = [t for layer in cache.cache.layers for t in (layer.keys, layer.values)]
            timings["device copy"] = lambda: [t.clone() for t in kv]
            timings["export via pinned"] = lambda: _pinned_copy(kv)
        ms = {name: _timed(device, step, HANDOFF_REPEATS) * 1e3 for name, step in timings.items()}
        mb = payload.nbytes / 1e6
        rows.append(f"{n} tokens, {mb:.1f} MB: " + ", ".join(f"{k} {v:.2f} ms ({mb / v:.1f} GB/s)" for k, v in ms.items()))
    return f"{dtype}; " + "; ".join(rows)


def _pinned_copy(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    """What an export through page-locked host memory costs (export copies to pageable memory, a tensor at a time):
    one pinned buffer from torch's caching host allocator, every tensor copied into it asynchronously, one sync."""
    host = torch.empty(sum(t.numel() for t in kv), dtype=kv[0].dtype, pin_memory=True)
    views, start = [], 0
    for t in kv:
        view = host[start:start + t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        views.append(view)
        start += t.numel()
    torch.cuda.current_stream(kv[0].device).synchronize()
    return views


def _default_shape(device, dtype: str):
    """The default target's architecture with random weights (its shapes are what the kernels see)."""
    from transformers import LlamaForCausalLM

    from services.loading import wrap_model
    from services.models import default_pair

    config = default_pair.architecture()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    return wrap_model(model, model_id=f"default-shape-{dtype}", dtype=dtype, device=str(device))


def _timed(device, step, repeats: int) -> float:
    """Seconds per call of ``step`` (after one call to warm up; the device's queue drained before and after)."""
    step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_difference(outputs: list[list[int]], expected: list[list[int]]) -> str:
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if got != want:
            return f"prompt {i} from token {first_difference(got, want)} of {len(want)}"
    return "lengths differ"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers differ (a length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


if __name__ == "__main__":
    sys.exit(main())
