"""Fail fast on unplaceable stages: Ray keeps a replica whose label or resource no node has pending, silently; and a
replica's own CPU set (``placement.cpus``).

``unplaceable(config, nodes)`` names every stage that no alive node can host
and says which label or resource is missing; the ingress refuses requests with
UNAVAILABLE while that is so, and `splitspec serve` reports it and exits.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from deployments.config import INGRESS, AppConfig, Placement


def unplaceable(config: AppConfig, nodes: Iterable[dict]) -> dict[str, str]:
    """{stage: why} for each stage that no alive node (as ``ray.nodes()`` lists them) can host."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    problems = {}
    for stage in (*config.deployed_stages(), INGRESS):
        why = _why_not(config.placement(stage), alive)
        if why:
            problems[stage] = f"stage {stage!r} cannot be placed: {why}"
    return problems


def _why_not(placement: Placement, nodes: list[dict]) -> str | None:
    if any(_fits(placement, n) for n in nodes):
        return None
    for key, value in placement.label_selector.items():
        if not any(_label_matches(n.get("Labels", {}), key, value) for n in nodes):
            return f"no alive node has label {key}={value} (start one with `ray start --labels {key}={value}`)"
    for name, amount in placement.resources.items():
        if not any(n.get("Resources", {}).get(name, 0) >= amount for n in nodes):
            return f"no alive node has resource {name} >= {amount} (start one with `ray start --resources '{{\"{name}\": 1}}'`)"
    if placement.num_gpus and not any(n.get("Resources", {}).get("GPU", 0) >= placement.num_gpus for n in nodes):
        return f"no alive node has {placement.num_gpus:g} GPU(s) (Ray counts a node's GPUs when it starts on a machine with CUDA)"
    return f"no single alive node has all of labels {placement.label_selector} and resources {placement.resources}" + (
        f" and {placement.num_gpus:g} GPU(s)" if placement.num_gpus else "")


def _fits(placement: Placement, node: dict) -> bool:
    labels, resources = node.get("Labels", {}), node.get("Resources", {})
    return all(_label_matches(labels, k, v) for k, v in placement.label_selector.items()) and all(
        resources.get(name, 0) >= amount for name, amount in placement.resources.items()
    ) and resources.get("CPU", 0) >= placement.num_cpus and resources.get("GPU", 0) >= placement.num_gpus


def _label_matches(labels: dict, key: str, selector: str) -> bool:
    """Ray's label selector syntax: ``v``, ``!v``, ``in(a,b)``, ``!in(a,b)``."""
    negate = selector.startswith("!")
    body = selector[1:] if negate else selector
    if body.startswith("in(") and body.endswith(")"):
        match = labels.get(key) in {v.strip() for v in body[3:-1].split(",")}
    else:
        match = labels.get(key) == body
    return match != negate


class CpuSetError(ValueError):
    """A replica's configured CPU set names CPUs its node does not offer it."""


def pin_cpus(cpus: list[int], stage: str) -> None:
    """Run every thread of this process (a replica's) on ``cpus`` (``placement.cpus``), and the threads they start
    after (a thread inherits its creator's CPU set); nothing when ``cpus`` is empty. Linux sets a CPU set per
    thread, so each of the process's threads is set (Ray's own, the event loop's, the engine's)."""
    if not cpus:
        return
    offered = os.sched_getaffinity(0)
    if not set(cpus) <= offered:
        raise CpuSetError(f"stages' {stage!r} placement.cpus {cpus} are not all CPUs of this node: it offers "
                          f"{sorted(offered)}")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):  # (a thread that ended meanwhile)
            continue
