"""Per-token arrival probe against a running service (``splitspec serve``), for diagnosing inter-token latency.

A closed loop at each concurrency (16 held-out prompts x 64 tokens, streamed), then: ITL p50 / p90 / p99 (a
chunk's gap spread over its tokens, as ``splitspec bench load`` counts it), the same over the gaps with no prefill
in flight (no request between its start and its first token), and the gap before each request's second token.
``splitspec bench load`` gives the figures; this tells where the tail comes from (README, "Under load").

Usage: .venv/bin/python scripts/itl_probe.py '{"speculate": false}' 1,8 48   # policy (JSON), levels, requests
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from splitspec import bench_grpc
from splitspec.client import SpecDecodeClient

MAX_NEW_TOKENS = 64


def one(client, prompt: str, policy: dict) -> tuple[float, list[tuple[float, int]]]:
    """(start, [(arrival, tokens in the chunk)]) of one streamed request."""
    start, stamps = time.perf_counter(), []
    for chunk in client.stream(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, **policy):
        if chunk.token_ids:
            stamps.append((time.perf_counter(), len(chunk.token_ids)))
    return start, stamps


def closed_loop(client, prompts: list[str], policy: dict, concurrency: int, requests: int) -> list:
    todo, lock, results = iter(range(requests)), threading.Lock(), []

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results.append(one(client, prompts[i % len(prompts)], policy))

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    return results


def gaps(results: list) -> list[tuple[float, int, int]]:
    """(gap per token, index of the chunk in its request, prefills in flight during the gap), a row per token."""
    firsts = [(start, stamps[0][0]) for start, stamps in results]
    rows = []
    for _, stamps in results:
        for k in range(1, len(stamps)):
            (t, n), before = stamps[k], stamps[k - 1][0]
            in_flight = sum(1 for start, first in firsts if start < t and first > before)
            rows += [((t - before) / n, k, in_flight)] * n
    return rows


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] * 1e3


def main() -> None:
    policy = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"speculate": False}
    levels = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
    prompts = bench_grpc.prompts_of("held_out")[:16]
    client = SpecDecodeClient("127.0.0.1:9000", timeout_s=120)
    one(client, prompts[0], policy)  # warm up
    for c in levels:
        requests = int(sys.argv[3]) if len(sys.argv) > 3 else max(16, 2 * c)
        results = closed_loop(client, prompts, policy, c, requests)
        json.dump(results, open(f"/tmp/stamps_c{c}.json", "w"))
        rows = gaps(results)
        every = [g for g, _, _ in rows]
        print(f"c={c}: n={len(every)} p50 {pct(every, .5):.1f} p90 {pct(every, .9):.1f} p99 {pct(every, .99):.1f}")
        clean = [g for g, _, in_flight in rows if in_flight == 0]
        if clean:
            print(f"   no prefill in flight: n={len(clean)} p50 {pct(clean, .5):.1f} p99 {pct(clean, .99):.1f}")
        second = sorted(round(g * 1e3) for g, k, _ in rows if k == 1)
        print(f"   2nd tokens (ms): {second}")


if __name__ == "__main__":
    main()
