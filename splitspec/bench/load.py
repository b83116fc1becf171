"""Throughput and latency under load through the gRPC service or its OpenAI API (closed loop by concurrency, and open
loop).

Every request streams (GenerateStream, or /v1/chat/completions with ``stream``
and per-chunk usage, vLLM's ``continuous_usage_stats``), so the client sees
each chunk when it is sent: TTFT is request sent -> first chunk, ITL the gap between chunks
spread over the chunk's tokens (a verify step sends its accepted tokens
together), TPOT (end-to-end - TTFT) / (tokens - 1), E2E request sent -> last
chunk. Names and meanings follow ``vllm bench serve``. Goodput counts the
requests that met the SLO (TTFT and TPOT). Greedy answers are checked
against each prompt's answer at concurrency 1 of the same policy.

Closed loop: ``c`` clients, each sending its next request when the previous
one ends. Open loop: requests arrive as a Poisson process at ``rate`` per
second whatever the service does (arrivals beyond the configured queue are
refused with RESOURCE_EXHAUSTED, counted under errors).
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from splitspec.api.client import SpecDecodeClient

POLICIES = {
    "off": dict(speculate=False),
    "server default": dict(),
    "eagle k=1": dict(speculate=True, drafter="eagle", num_draft_tokens=1),
    "eagle k=2": dict(speculate=True, drafter="eagle", num_draft_tokens=2),
}
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
PERCENTILES = (50, 90, 99)


@dataclass
class Outcome:
    prompt: int
    status: str = "OK"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the OpenAI API's answer (it has no token ids: greedy answers are compared by text)
    tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one per token after the first chunk


class OpenAIEndpoint:
    """The service's OpenAI-compatible API (``base_url`` http://host:port/v1), streamed with the standard library."""

    SPECULATION = {None: None, True: "on", False: "off"}  # a POLICIES entry's ``speculate`` -> speculation.mode

    def __init__(self, base_url: str, timeout_s: float = 600.0, token: str = ""):
        self.base_url, self.timeout_s, self.token = base_url.rstrip("/"), timeout_s, token

    def body(self, prompt: str, policy: dict, max_new_tokens: int) -> dict:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        mode = self.SPECULATION[policy.get("speculate")]
        if mode:
            body["speculation"] = {"mode": mode, "drafter": policy.get("drafter", ""),
                                   "num_draft_tokens": policy.get("num_draft_tokens", 0)}
        return body

    def events(self, body: dict):
        """The stream's JSON events; urllib.error.HTTPError for a refused request."""
        headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {self.token}"} if self.token else {})
        request = urllib.request.Request(f"{self.base_url}/chat/completions", data=json.dumps(body).encode(),
                                         headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    yield json.loads(line.removeprefix("data: "))


def _one(client, prompt_index: int, prompt: str, policy: dict, max_new_tokens: int) -> Outcome:
    if isinstance(client, OpenAIEndpoint):
        return _one_openai(client, prompt_index, prompt, policy, max_new_tokens)
    outcome = Outcome(prompt_index)
    start = last = time.perf_counter()
    try:
        for chunk in client.stream(messages=[("user", prompt)], max_new_tokens=max_new_tokens, **policy):
            now = time.perf_counter()
            n = len(chunk.token_ids)
            if n:
                if outcome.ttft_s is None:
                    outcome.ttft_s = now - start
                else:
                    outcome.itl_s += [(now - last) / n] * n
                last = now
                outcome.token_ids += chunk.token_ids
        outcome.e2e_s = time.perf_counter() - start
    except grpc.RpcError as exc:
        outcome.status = exc.code().name
    outcome.tokens = len(outcome.token_ids)
    return outcome


def _one_openai(api: OpenAIEndpoint, prompt_index: int, prompt: str, policy: dict, max_new_tokens: int) -> Outcome:
    """As ``_one``; a chunk's tokens are the growth of its usage (continuous_usage_stats)."""
    outcome = Outcome(prompt_index)
    start = last = time.perf_counter()
    try:
        for event in api.events(api.body(prompt, policy, max_new_tokens)):
            if "error" in event:
                outcome.status = f"HTTP {event['error']['code']}"
                return outcome
            now = time.perf_counter()
            n = (event.get("usage") or {}).get("completion_tokens", outcome.tokens) - outcome.tokens
            if event["choices"] and n:
                if outcome.ttft_s is None:
                    outcome.ttft_s = now - start
                else:
                    outcome.itl_s += [(now - last) / n] * n
                last = now
                outcome.tokens += n
                outcome.text += event["choices"][0]["delta"].get("content") or ""
        outcome.e2e_s = time.perf_counter() - start
    except urllib.error.HTTPError as exc:
        outcome.status = f"HTTP {exc.code}"
    return outcome


def _answer(outcome: Outcome):
    return outcome.text if not outcome.token_ids else outcome.token_ids


def _percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    ordered = sorted(values)
    out = {f"p{p}": round(ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))] * scale, 1) for p in PERCENTILES}
    return out | {"mean": round(sum(values) / len(values) * scale, 1)}


def tpot_s(o: Outcome) -> float | None:
    """Time per output token after the first; None with fewer than two tokens."""
    return (o.e2e_s - o.ttft_s) / (o.tokens - 1) if o.ttft_s is not None and o.tokens > 1 else None


def summarize(outcomes: list[Outcome], seconds: float, *, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    done = [o for o in outcomes if o.status == "OK"]
    tokens = sum(o.tokens for o in done)
    tpot = [t for o in done if (t := tpot_s(o)) is not None]
    good = [o for o in done if o.ttft_s is not None and o.ttft_s * 1000 <= slo_ttft_ms
            and ((t := tpot_s(o)) is None or t * 1000 <= slo_tpot_ms)]
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "errors": dict(Counter(o.status for o in outcomes if o.status != "OK")),
        "duration_s": round(seconds, 2),
        "output_throughput_tok_s": round(tokens / seconds, 2),
        "request_throughput_req_s": round(len(done) / seconds, 3),
        "goodput_req_s": round(len(good) / seconds, 3),
        "ttft_ms": _percentiles([o.ttft_s for o in done if o.ttft_s is not None]),
        "itl_ms": _percentiles([x for o in done for x in o.itl_s]),
        "tpot_ms": _percentiles(tpot),
        "e2e_ms": _percentiles([o.e2e_s for o in done]),
    }


def closed_loop(client, prompts: list[str], policy: dict, *, concurrency: int, num_requests: int, max_new_tokens: int):
    """``concurrency`` clients in a loop until ``num_requests`` have been sent; prompts taken in turn."""
    next_index, lock = iter(range(num_requests)), threading.Lock()

    def worker() -> list[Outcome]:
        mine = []
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return mine
            mine.append(_one(client, i % len(prompts), prompts[i % len(prompts)], policy, max_new_tokens))

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = [o for f in [pool.submit(worker) for _ in range(concurrency)] for o in f.result()]
    return outcomes, time.perf_counter() - start


def open_loop(client, prompts: list[str], policy: dict, *, rate: float, num_requests: int, max_new_tokens: int,
              seed: int = 0):
    """Poisson arrivals at ``rate`` requests/s (exponential gaps, seeded)."""
    gaps = random.Random(seed)
    start = time.perf_counter()
    futures = []
    with ThreadPoolExecutor(num_requests) as pool:
        arrival = 0.0
        for i in range(num_requests):
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(_one, client, i % len(prompts), prompts[i % len(prompts)], policy, max_new_tokens))
            arrival += gaps.expovariate(rate)
        outcomes = [f.result() for f in futures]
    return outcomes, time.perf_counter() - start


def run(client: SpecDecodeClient | OpenAIEndpoint, prompts: list[str], *, policies: list[str], concurrency=DEFAULT_CONCURRENCY,
        requests_per_level: int = 0, rate: float = 0.0, open_requests: int = 32, max_new_tokens: int = 64,
        slo_ttft_ms: float = 2000.0, slo_tpot_ms: float = 200.0, log=print) -> dict:
    """Every policy at every concurrency (then the open loop at ``rate``, if set); greedy answers compared."""
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {list(POLICIES)}")
    report = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
              "closed_loop": {}, "open_loop": {}}
    reference: dict[int, list[int]] = {}  # prompt -> greedy answer (every policy, every concurrency must give it)
    identical = True
    for name in policies:
        policy = POLICIES[name]
        _one(client, 0, prompts[0], policy, 8)  # warm the path of this policy
        rows = {}
        for c in concurrency:
            n = requests_per_level or max(len(prompts), 2 * c)
            outcomes, seconds = closed_loop(client, prompts, policy, concurrency=c, num_requests=n, max_new_tokens=max_new_tokens)
            for o in outcomes:
                if o.status == "OK":
                    identical &= reference.setdefault(o.prompt, _answer(o)) == _answer(o)
            rows[str(c)] = summarize(outcomes, seconds, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
            r = rows[str(c)]
            log(f"  {name:<15} c={c:<3} {r['output_throughput_tok_s']:7.2f} tok/s  ttft p50 {r['ttft_ms']['p50']} ms  "
                f"itl p50/p99 {r['itl_ms']['p50']}/{r['itl_ms']['p99']} ms  errors {r['errors'] or 0}")
        single = rows[str(concurrency[0])]["output_throughput_tok_s"]
        for r in rows.values():
            r["throughput_vs_first"] = round(r["output_throughput_tok_s"] / single, 2) if single else None
        report["closed_loop"][name] = rows
        if rate > 0:
            outcomes, seconds = open_loop(client, prompts, policy, rate=rate, num_requests=open_requests,
                                          max_new_tokens=max_new_tokens)
            for o in outcomes:
                if o.status == "OK":
                    identical &= reference.setdefault(o.prompt, _answer(o)) == _answer(o)
            report["open_loop"][name] = {"rate_req_s": rate} | summarize(outcomes, seconds, slo_ttft_ms=slo_ttft_ms,
                                                                          slo_tpot_ms=slo_tpot_ms)
            r = report["open_loop"][name]
            log(f"  {name:<15} rate={rate}/s {r['output_throughput_tok_s']:7.2f} tok/s  ttft p50 {r['ttft_ms']['p50']} ms  "
                f"errors {r['errors'] or 0}")
    report["greedy_identical"] = identical
    return report


def plot(report: dict, path: str) -> None:
    """Throughput vs concurrency, and ITL p50 / p99 vs concurrency, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in report["closed_loop"].items():
        levels = [int(c) for c in rows]
        left.plot(levels, [r["output_throughput_tok_s"] for r in rows.values()], marker="o", label=name)
        line = right.plot(levels, [r["itl_ms"]["p50"] for r in rows.values()], marker="o", label=f"{name} p50")[0]
        right.plot(levels, [r["itl_ms"]["p99"] for r in rows.values()], marker="x", linestyle="--",
                   color=line.get_color(), label=f"{name} p99")
    for ax, ylabel in ((left, "output tokens / s"), (right, "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"splitspec under load: {report['prompts']} prompts x {report['max_new_tokens']} tokens, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
