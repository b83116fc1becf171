"""The remote layout, two replicas per stage and 8 concurrent streams: every answer is correct, so each session's calls met its replica."""

import concurrent.futures

import pytest
from ray import serve

from splitspec.bench import soak
from tests.serving.conftest import MAX_NEW_TOKENS, PROMPTS, make_config, serving, until

pytestmark = pytest.mark.slow

TWO = {"num_replicas": 2}


@pytest.fixture(scope="module")
def client():
    with serving(make_config(stages={"prefill": TWO, "draft": TWO, "verify": TWO}, ingress_replicas=2,
                                 speculation={"drafting": "remote"})) as client:
        yield client


def _replica_stats(deployment: str, calls: int = 24) -> dict[str, dict]:
    handle = serve.get_deployment_handle(deployment, "splitspec")
    stats = [handle.stats.remote().result() for _ in range(calls)]
    return {s["replica_id"]: s for s in stats}


@pytest.mark.parametrize("drafter,k", [("model", 3), ("eagle", 3), ("prompt_lookup", 5)])
def test_concurrent_streams_with_two_replicas_per_stage(client, reference, drafter, k):
    def run(prompt):
        chunks = list(client.stream(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, drafter=drafter,
                                    num_draft_tokens=k))
        return [t for c in chunks for t in c.token_ids]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(run, PROMPTS))
    for prompt, tokens in zip(PROMPTS, answers):
        assert tokens == reference(prompt), prompt


def test_both_replicas_held_sessions_and_closed_them(client):
    for deployment in ("Draft", "Verify"):
        stats = _replica_stats(deployment)
        assert len(stats) == 2, f"{deployment}: expected 2 replicas, saw {list(stats)}"
        assert all(s["opened"] > 0 for s in stats.values()), stats  # the load spread over both
    # the ingress sends closes without waiting for them: poll until every session is closed
    until("every session closed", lambda: all(
        s["sessions"] == 0 for deployment in ("Draft", "Verify") for s in _replica_stats(deployment).values()))


def test_soak_leaves_nothing_behind(client):
    """40 requests, 8 at a time, of every kind (unary and streams, every policy, some cancelled, some past a short
    deadline), over two replicas per stage and two ingress replicas: no unexpected outcome, every session closed,
    the object store back to its baseline, replica memory flat (splitspec.bench.soak; `splitspec soak` runs 500 x 32)."""
    report = soak.run(client, [p for p in PROMPTS], requests=40, concurrency=8, seed=1, progress=lambda _: None)
    assert report["unexpected"] == [], report["unexpected"]
    assert report["ok"], {k: report[k] for k in ("invariants", "object_store_bytes", "open_after", "rss_bytes")}
    assert sum(n for outcome, n in report["outcomes"].items() if outcome.startswith("wait")) > 20, report["outcomes"]


def test_client_going_away_closes_its_sessions(client):
    """A stream cancelled mid-way releases its draft and verify sessions; the next request is served."""
    stream = client.stream(messages=[("user", PROMPTS[0])], max_new_tokens=200, num_draft_tokens=2)
    for _, _chunk in zip(range(3), stream):
        pass
    stream.cancel()
    until("the cancelled stream's sessions closed", lambda: all(
        s["sessions"] == 0 for deployment in ("Draft", "Verify") for s in _replica_stats(deployment).values()))
    assert client.generate(messages=[("user", PROMPTS[1])], max_new_tokens=8).usage.completion_tokens > 0
