"""A real local Ray cluster with the app deployed, and a real gRPC client on 127.0.0.1 (one per test module)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import pytest
from ray import serve

from deployments.config import DEFAULT_APP_NAME, AppConfig
from services.text import encode_prompt
from splitspec.api.client import SpecDecodeClient
from splitspec.cluster import free_port
from tests.conftest import greedy_reference

# Chat prompts of the greedy-equality tests (>= 8, as issue 3 asks).
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Count from 1 to 10.",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci.",
]
MAX_NEW_TOKENS = 24
BOUND_S = 180  # bounds a wait for a replica to hold a call or come back (seconds in practice)




def in_pairs(client, prompts: list[str], **policy) -> list[tuple[str, object]]:
    """(prompt, its unary response) for each prompt, sent two at a time (the verify replica batches them: the suite's
    time; two is within the adaptive policy's off_above_concurrency, so adaptive requests still draft)."""
    import concurrent.futures

    def ask(prompt):
        return client.generate(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, **policy)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(zip(prompts, pool.map(ask, prompts)))


def make_config(**overrides) -> AppConfig:
    """Small limits so that the tests are quick; ``overrides`` merge into the dict form."""
    data = AppConfig().model_dump()
    # (limits.stage_timeout_s stays the default, 120 s: a request that lost its verify replica waits for the
    # replacement within it, and a replacement took 94 s to start on a loaded 2-core machine; BOUND_S is above it)
    data["limits"].update(max_new_tokens=256, default_max_new_tokens=MAX_NEW_TOKENS)
    for key, value in overrides.items():
        if isinstance(value, dict):
            _merge(data[key], value)
        else:
            data[key] = value
    return AppConfig.model_validate(data)


def _merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


_shared: dict = {"cluster": None}  # the one-node cluster that modules serving one after the other share


def shared_cluster():
    """The session's one-node local cluster (no dashboard), started on first use: a module that serves on it
    starts Serve and its app, and stops only Serve when it ends (Ray's start and stop are seconds a module). Its node
    declares one GPU that no device backs (no test's stage asks for one but test_gpu_serve_check's, which deploys a
    cuda stage where torch sees no GPU)."""
    from splitspec import cluster

    if _shared["cluster"] is None:
        _shared["cluster"] = cluster.LocalCluster(nodes=1, dashboard=False, log_to_driver=False, gpus=1).start()
    return _shared["cluster"]


def stop_shared_cluster() -> None:
    """Before a cluster of another kind starts (in this process or another): one cluster on the machine at a time."""
    local, _shared["cluster"] = _shared["cluster"], None
    if local is not None:
        local.stop()


@contextlib.contextmanager
def serving(config: AppConfig, *, nodes: int = 1, dashboard: bool = False, direct_ingress: bool | None = None,
            token: str | None = None):
    """Deploy ``config`` pinned for a local cluster of ``nodes`` nodes, yield a gRPC client (its ``http_base_url`` is
    the OpenAI-compatible API's, http://127.0.0.1:<port>/v1). One node without a dashboard: on the shared cluster
    (``shared_cluster``), Serve stopped at the end; else a cluster of its own. ``direct_ingress``: the ingress replica
    serves the ports, as `splitspec serve` runs it (default: where it does, one ingress replica); False: through
    Serve's proxy (a test that deploys more applications beside it). ``token``: the client's bearer token (the
    config's auth)."""
    from ray import serve as ray_serve

    from splitspec import cluster

    port, http_port = free_port(), free_port()
    own = nodes != 1 or dashboard
    if own:
        stop_shared_cluster()
        local = cluster.LocalCluster(nodes=nodes, dashboard=dashboard, log_to_driver=False).start()
    else:
        shared_cluster()
    try:
        cluster.serve_local(config, nodes, port, http_port, direct_ingress=direct_ingress)
        with SpecDecodeClient(f"127.0.0.1:{port}", timeout_s=300, token=token) as client:
            client.http_base_url = f"http://127.0.0.1:{http_port}/v1"
            yield client
    finally:
        if own:
            local.stop()
        else:
            try:
                ray_serve.shutdown()
            except Exception:  # noqa: BLE001 - a Serve that will not stop: stop the whole cluster
                stop_shared_cluster()


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_cluster_at_the_end():
    yield
    stop_shared_cluster()


# -- stage replicas through their handles (deployments.faults needs faults.enabled in the config) --------------


def handle(deployment: str, app: str = DEFAULT_APP_NAME):
    return serve.get_deployment_handle(deployment, app)


def arm(deployment: str, method: str, action: str, after: int = 0) -> str:
    """Arm the deployment's (only) replica; returns its actor name."""
    return handle(deployment).arm_fault.remote(method, action, after).result(timeout_s=60)


def until(what: str, check, bound_s: float = BOUND_S, done=bool):
    """check()'s first value that is ``done``; an error (a replica gone or not back yet) counts as not yet."""
    deadline, value = time.monotonic() + bound_s, None
    while True:
        try:
            value = check()
            if done(value):
                return value
        except Exception as exc:  # noqa: BLE001 - a replica that is gone or not yet back: ask again
            value = exc
        assert time.monotonic() < deadline, f"{what}: not within {bound_s}s (last: {value!r})"
        time.sleep(0.2)


def local_prefills() -> int:
    """Prompts the Prefill replica handed to the verify replica to finish (limits.local_prefill_tokens)."""
    return handle("Prefill").stats.remote().result(timeout_s=60)["local_prefills"]


def held(deployment: str) -> bool:
    return handle(deployment).stats.remote().result(timeout_s=10)["held"] > 0


def open_sessions() -> dict[str, int]:
    """Sessions open, KV bytes held and loops running on the Verify replica, its own drafter's sessions (drafting
    local), and the Draft replica's sessions and KV where the app has a draft stage (drafting remote)."""
    stats = {"Verify": handle("Verify").stats.remote().result(timeout_s=60)}
    if stats["Verify"]["drafting"] == "remote":
        stats["Draft"] = handle("Draft").stats.remote().result(timeout_s=60)
    held = {f"{d} {what}": s[what] for d, s in stats.items() for what in ("sessions", "kv_bytes")}
    return {**held, "Verify draft_sessions": stats["Verify"]["draft_sessions"], "Verify loops": stats["Verify"]["loops"]}


@pytest.fixture(scope="session")
def target_info(default_pair):
    from services.loading import describe
    from services.models import default_pair as dp

    return describe(dp.target_dir())


@pytest.fixture(scope="session")
def reference(default_pair, target_info):
    """Greedy tokens of the target alone (transformers generate, do_sample=False) for a chat prompt."""
    target, _ = default_pair

    def ref(prompt: str, max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
        ids = encode_prompt(target_info.tokenizer, "", [("user", prompt)])
        return greedy_reference(target.model, ids, max_new_tokens)

    return ref


def assert_second_token_follows_the_target(client, default_pair, target_info, draws: int) -> None:
    """Seeded draws with EAGLE drafts (k = 2): given the first token, the second — the first verify step's, an
    accepted draft or a recovered token — follows the target's p (chi-square)."""
    import torch

    from services.sampling import SamplingParams, logits_to_probs
    from tests.services.test_sampling import assert_follows

    target, _ = default_pair
    prompt = "The capital of France is"  # raw text: the first token is nearly always " Paris", the next one is not
    seconds: dict[int, list[int]] = {}
    drafted = 0

    def draw(seed: int):
        return client.generate(prompt, max_new_tokens=4, temperature=1.0, seed=seed, drafter="eagle",
                               num_draft_tokens=2)  # 4: room for 2 drafts after the first token

    # 8 at a time: their steps share batched passes, where each session's draws are its own (batch invariance)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(draw, range(draws)))
    for response in responses:
        first, second = response.token_ids[:2]
        seconds.setdefault(first, []).append(second)
        drafted += response.speculation_stats.drafted
    first, seconds_drawn = max(seconds.items(), key=lambda kv: len(kv[1]))
    assert len(seconds_drawn) >= draws // 2 and drafted > 0, \
        f"{len(seconds_drawn)} draws after the likeliest first token, {drafted} drafted"
    ids = encode_prompt(target_info.tokenizer, prompt, []) + [first]
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([ids])).logits[0, -1:]
    p = logits_to_probs(logits.float(), SamplingParams(temperature=1.0))[0]  # [vocab_size]
    assert_follows(torch.bincount(torch.tensor(seconds_drawn), minlength=p.shape[0]).float(), p)
