"""The application builder: ``import_path: deployments.app:build_app`` for `serve run` / `serve deploy`.

    app = build_app({"stages": {"verify": {"num_replicas": 2}}})

wires Prefill, Verify and, where requests draft remotely (speculation.drafting),
Draft (each pinned by its placement, with the session-affinity router on the
stateful ones) under the gRPC ingress.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from deployments.config import AppConfig, Placement
from deployments.ingress import SpecDecodeIngress
from deployments.routing import ROUTER_CLASS
from deployments.stages import Draft, Prefill
from deployments.verify import Verify

GRPC_SERVICER = "splitspec.api.v1.splitspec_pb2_grpc.add_SpecDecodeServicer_to_server"
# the standard grpc.health.v1.Health service (Kubernetes' gRPC probes), answered by the ingress's Check
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
GRPC_SERVICERS = [GRPC_SERVICER, HEALTH_SERVICER]
# Serve runs a replica's methods on an event loop in a thread of their own, and the router of the handles it calls on
# another; a streamed item then crosses both threads in each replica it passes. config.replica_one_loop: one loop.
LOOP_ENV_VARS = ("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP")
# Serve's direct ingress in the ingress replica (config.direct_ingress): it serves the ports, and a stop does not
# wait out Serve's 30-s drain for an external load balancer (there is none: clients connect to the replica)
DIRECT_INGRESS_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}
QUEUE_FULL_RETRY_AFTER_S = 1  # what a client told "queue full" (HTTP 429) is asked to wait
# Serve's default health-check period is fine; replicas load models in their constructor.
# A stopping replica polls its in-flight calls this often (Serve's default, 2 s, is first slept out even when the
# replica is idle: every stop took 2 s more).
DRAIN_POLL_S = 0.2
STAGE_DEPLOYMENTS = {"prefill": Prefill, "draft": Draft, "verify": Verify}  # (in this order: verify binds the others)


def build_app(args: dict[str, Any] | None = None) -> Application:
    config = AppConfig.model_validate(args or {})
    plain = config.model_dump()
    stages = {}
    for name in config.deployed_stages():  # (the draft stage only where requests draft remotely)
        deployment, stage = STAGE_DEPLOYMENTS[name], config.stage(name)
        options: dict[str, Any] = {
            "num_replicas": stage.num_replicas,
            "max_ongoing_requests": stage.max_ongoing_requests,
            "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
            "ray_actor_options": actor_options(stage.placement, config.replica_one_loop),
            "logging_config": {"enable_access_log": config.stage_access_log},
        }
        if name != "prefill":  # draft and verify hold sessions: pin each call to its replica
            options["request_router_config"] = RequestRouterConfig(request_router_class=ROUTER_CLASS)
        extra = (stages["prefill"], stages.get("draft")) if name == "verify" else ()
        stages[name] = deployment.options(**options).bind(plain, *extra)
    ingress = SpecDecodeIngress.options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=config.limits.max_ongoing_requests,
        max_queued_requests=config.limits.max_queued_requests,
        # a full queue: HTTP 429 with Retry-After, as the OpenAI API answers (gRPC: RESOURCE_EXHAUSTED either way)
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=QUEUE_FULL_RETRY_AFTER_S),
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        ray_actor_options=actor_options(config.ingress_placement, config.replica_one_loop,
                                        DIRECT_INGRESS_ENV if config.direct_ingress else {}),
    )
    return ingress.bind(plain, stages["prefill"], stages["verify"])


def actor_options(placement: Placement, one_loop: bool = True, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Ray actor options that pin a replica (custom resources and/or a node label selector) and say where it runs its
    methods and its handles' router: on its own event loop (``one_loop``), or each on a thread of its own; ``env``:
    more of the replica's environment."""
    env_vars = {name: "0" if one_loop else "1" for name in LOOP_ENV_VARS} | dict(env or {})
    options: dict[str, Any] = {"num_cpus": placement.num_cpus, "runtime_env": {"env_vars": env_vars}}
    if placement.num_gpus:
        options["num_gpus"] = placement.num_gpus
    if placement.resources:
        options["resources"] = dict(placement.resources)
    if placement.label_selector:
        options["label_selector"] = dict(placement.label_selector)
    return options
