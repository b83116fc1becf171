"""Soak: many requests of every kind through the gRPC service, then check that nothing leaked.

``run`` sends ``requests`` requests, ``concurrency`` at a time, each drawn from
a seeded generator (a run can be repeated):

- the RPC: Generate (unary) or GenerateStream;
- the policy: speculation off, the server default, a drafter with k pinned
  (EAGLE, the draft model, prompt lookup), pre-drafting, or seeded sampling;
- what the client does: wait for the answer, cancel the stream after its
  second chunk, or give the call a deadline shorter than the answer takes.

Then, once the service is idle (polled, with a bound), the invariants — counts
and bytes, never times:

- no unexpected outcome: a request the client waits for is OK, a cancelled
  stream CANCELLED (or OK if it ended first), a short deadline
  DEADLINE_EXCEEDED (or OK);
- every draft and verify session is closed and the ingress runs no request;
- the object store holds no more bytes than before (no leaked KV reference);
- each replica's resident memory after the run is within ``RSS_GROWTH`` of
  what it was after the warm-up.

It needs the service's Serve handles: a cluster this process started or joined.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from splitspec.api.client import SpecDecodeClient, make_request

POLICIES = {
    "off": dict(speculate=False),
    "server default": dict(),
    "eagle k=2": dict(speculate=True, drafter="eagle", num_draft_tokens=2),
    "model k=3": dict(speculate=True, drafter="model", num_draft_tokens=3),
    "prompt lookup k=4": dict(speculate=True, drafter="prompt_lookup", num_draft_tokens=4),
    "eagle k=2 pre-drafting": dict(speculate=True, drafter="eagle", num_draft_tokens=2, overlap=True),
    "sampled": dict(temperature=0.8, top_p=0.95),  # seeded per request
}
WAIT, CANCEL, SHORT_DEADLINE = "wait", "cancel", "short deadline"
ACTIONS = {WAIT: 0.7, CANCEL: 0.15, SHORT_DEADLINE: 0.15}
EXPECTED = {WAIT: {"OK"}, CANCEL: {"CANCELLED", "OK"}, SHORT_DEADLINE: {"DEADLINE_EXCEEDED", "OK"}}
RSS_GROWTH = 0.25  # resident memory a replica may gain after the warm-up (allocator noise, not a leak)
OBJECT_STORE_SLACK_BYTES = 0  # the object store goes back to exactly its baseline
SETTLE_S = 120.0  # how long the service may take to close everything after the last request
GC_AFTER_S = 5.0  # idle this long with the store above its baseline: ask the replicas to collect garbage


@dataclass
class Planned:
    index: int
    prompt: str
    rpc: str  # "unary" | "stream"
    policy: str
    action: str
    max_new_tokens: int
    deadline_s: float | None = None


def plan(requests: int, prompts: list[str], seed: int = 0) -> list[Planned]:
    rng = random.Random(seed)
    out = []
    for i in range(requests):
        rpc = rng.choice(("unary", "stream"))
        action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        if action == CANCEL and rpc == "unary":  # a unary call cannot be cancelled half-way by this client
            action = SHORT_DEADLINE
        out.append(Planned(i, rng.choice(prompts), rpc, rng.choice(list(POLICIES)), action, rng.randint(8, 48),
                           rng.uniform(0.1, 1.5) if action == SHORT_DEADLINE else None))
    return out


def _send(client: SpecDecodeClient, p: Planned) -> str:
    policy = dict(POLICIES[p.policy])
    if p.policy == "sampled":
        policy["seed"] = p.index
    request = make_request(messages=[("user", p.prompt)], max_new_tokens=p.max_new_tokens, request_id=f"soak-{p.index}",
                           stream=p.rpc == "stream", **policy)
    timeout = p.deadline_s or client.timeout_s
    try:
        if p.rpc == "unary":
            client.stub.Generate(request, metadata=client.metadata, timeout=timeout)
            return "OK"
        stream = client.stub.GenerateStream(request, metadata=client.metadata, timeout=timeout)
        for n, chunk in enumerate(stream, 1):
            if p.action == CANCEL and n == 2:
                stream.cancel()
            if chunk.finish_reason:
                return "OK"
        return "NO_FINISH_REASON"  # a stream that ended without its last chunk: unexpected
    except grpc.RpcError as exc:
        return exc.code().name


# -- what the service holds ----------------------------------------------------------------------


def replica_stats(app: str, replicas_per_deployment: int = 2) -> dict[str, dict[str, dict]]:
    """deployment -> replica id -> its stats(), for the stages and the ingress. Draft and Verify replicas (they hold
    the sessions) are each asked directly, through the session-affinity router; the others often enough that the
    router meets every replica."""
    import ray
    from splitspec import cluster

    from deployments.routing import pin

    out = {}
    for deployment in ("Prefill", "Draft", "Verify", "SpecDecodeIngress"):
        handle = cluster.handle(deployment, app)
        if deployment in ("Draft", "Verify"):
            prefix = f"SERVE_REPLICA::{app}#{deployment}#"
            ids = [a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(prefix)]
            calls = [handle.options(session_id=pin(replica_id)) for replica_id in ids]
        else:
            calls = [handle] * (8 * replicas_per_deployment)
        stats = [h.stats.remote().result(timeout_s=60) for h in calls]
        out[deployment] = {s["replica_id"]: s for s in stats}
    return out


def object_store_bytes() -> int:
    """Bytes in use in the object stores of every alive node."""
    import ray

    from splitspec.cluster import store_stats

    return sum(store_stats(n["NodeID"]).object_store_bytes_used for n in ray.nodes() if n["Alive"])


def _open(stats: dict) -> dict[str, int]:
    return {"draft_sessions": sum(s["sessions"] for s in stats["Draft"].values()),
            "verify_sessions": sum(s["sessions"] for s in stats["Verify"].values()),
            "ingress_active": sum(s["active"] for s in stats["SpecDecodeIngress"].values())}


def _rss(stats: dict) -> dict[str, int]:
    return {f"{d}/{rid}": s["rss_bytes"] for d, replicas in stats.items() for rid, s in replicas.items()}


def run(client: SpecDecodeClient, prompts: list[str], *, requests: int = 500, concurrency: int = 32, seed: int = 0,
        warmup: int | None = None, app: str = "splitspec", replicas_per_deployment: int = 2, progress=print) -> dict:
    """Soak the service at ``client`` (see the module docstring); the report's ``invariants`` say what held.

    The baseline is taken after ``warmup`` requests (default: 2 x concurrency) at the same concurrency, so that
    every policy's code and the buffers of a full batch exist before it."""
    planned = plan(requests, prompts, seed)
    warming = plan(2 * concurrency if warmup is None else warmup, prompts, seed + 1)
    for p in warming:
        p.action, p.deadline_s = WAIT, None
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda p: _send(client, p), warming))
    settled = _settle(app, replicas_per_deployment)
    baseline_store, baseline_rss = object_store_bytes(), _rss(settled)
    outcomes: Counter = Counter()
    unexpected: list[dict] = []
    lock, done = threading.Lock(), [0]
    start = time.perf_counter()

    def one(p: Planned) -> None:
        status = _send(client, p)
        with lock:
            outcomes[(p.action, status)] += 1
            if status not in EXPECTED[p.action]:
                unexpected.append({"request": p.index, "rpc": p.rpc, "policy": p.policy, "action": p.action,
                                   "status": status})
            done[0] += 1
            if done[0] % max(1, requests // 10) == 0:
                progress(f"  {done[0]}/{requests} requests, {len(unexpected)} unexpected")

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, planned))
    seconds = time.perf_counter() - start
    collected: list[int] = []
    after = _settle(app, replicas_per_deployment, baseline_store, collected)
    store_after, rss_after = object_store_bytes(), _rss(after)
    rss = {r: {"after_warmup": baseline_rss[r], "after_run": rss_after[r],
               "growth": round(rss_after[r] / baseline_rss[r] - 1, 4)} for r in baseline_rss if r in rss_after}
    open_after = _open(after)
    invariants = {
        "no unexpected outcome": not unexpected,
        "every session closed, no request running": not any(open_after.values()),
        "object store back to its baseline": store_after <= baseline_store + OBJECT_STORE_SLACK_BYTES,
        f"replica RSS within {RSS_GROWTH:.0%} of its post-warm-up size": all(
            r["growth"] <= RSS_GROWTH for r in rss.values()),
        "every replica measured before and after": set(rss) == set(baseline_rss),
    }
    return {
        "requests": requests, "concurrency": concurrency, "seed": seed, "seconds": round(seconds, 1),
        "outcomes": {f"{action}: {status}": n for (action, status), n in sorted(outcomes.items())},
        "unexpected": unexpected,
        "open_after": open_after,
        "opened_sessions": {d: sum(s["opened"] for s in after[d].values()) for d in ("Draft", "Verify")},
        "object_store_bytes": {"baseline": baseline_store, "after": store_after},
        "garbage_collected": collected[0] if collected else None,  # objects the replicas' cycle collectors found
        "rss_bytes": rss,
        "invariants": invariants,
        "ok": all(invariants.values()),
    }


def _settle(app: str, replicas_per_deployment: int, store_bound: int | None = None,
            collected: list | None = None) -> dict:
    """The replicas' stats once no session is open and no request runs (and, with ``store_bound``, the object store
    is back within it); the last stats seen if that does not happen within SETTLE_S.

    An idle replica's Python may not run its cycle collector for a long time, and a reference cycle (a failed or
    cancelled call's traceback) can hold a zero-copy view of an object in the store: after GC_AFTER_S idle, every
    replica is asked to collect its garbage once (counted in ``collected``): what is freed then was not leaked."""
    start = time.monotonic()
    deadline, idle_since = start + SETTLE_S, None
    while True:
        stats = replica_stats(app, replicas_per_deployment)
        idle = not any(_open(stats).values())
        if idle and (store_bound is None or object_store_bytes() <= store_bound + OBJECT_STORE_SLACK_BYTES):
            return stats
        if time.monotonic() > deadline:
            return stats
        idle_since = (idle_since or time.monotonic()) if idle else None
        if idle and collected is not None and not collected and time.monotonic() - idle_since > GC_AFTER_S:
            collected.append(_collect_garbage(app, stats))
        time.sleep(0.5)


def _collect_garbage(app: str, stats: dict) -> int:
    """Ask every replica in ``stats`` to run Python's cycle collector; the objects it found, in all."""
    from splitspec import cluster

    from deployments.routing import pin

    found = 0
    for deployment, replicas in stats.items():
        handle = cluster.handle(deployment, app)
        if deployment in ("Draft", "Verify"):
            found += sum(handle.options(session_id=pin(r)).collect_garbage.remote().result(timeout_s=60) for r in replicas)
        else:
            found += sum(handle.collect_garbage.remote().result(timeout_s=60) for _ in range(8 * len(replicas)))
    return found
