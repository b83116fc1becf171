"""A real local Ray cluster with the app deployed, and a real gRPC client on 127.0.0.1 (one per test module)."""

from __future__ import annotations

import contextlib
import socket

import pytest

from deployments.config import AppConfig
from services.text import encode_prompt
from splitspec.client import SpecDecodeClient
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(**overrides) -> AppConfig:
    """Small limits so that the tests are quick; ``overrides`` merge into the dict form."""
    data = AppConfig().model_dump()
    data["limits"].update(max_new_tokens=256, default_max_new_tokens=MAX_NEW_TOKENS, stage_timeout_s=60)
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


@contextlib.contextmanager
def serving(config: AppConfig, *, nodes: int = 1, dashboard: bool = False):
    """Start a local cluster of ``nodes`` nodes, deploy ``config`` pinned for it, yield a gRPC client."""
    from splitspec import cluster

    port = free_port()
    local = cluster.LocalCluster(nodes=nodes, dashboard=dashboard, log_to_driver=False).start()
    try:
        cluster.start_serve(port)
        cluster.deploy(cluster.placements_for(nodes, config))
        with SpecDecodeClient(f"127.0.0.1:{port}", timeout_s=300) as client:
            yield client
    finally:
        local.stop()


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
