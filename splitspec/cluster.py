"""Start a local Ray cluster for splitspec and deploy the app on it (used by `splitspec serve` and the tests).

``nodes=1``: one node that carries every stage's resource. ``nodes=3``: a head
node (ingress, proxy, controller) plus three nodes labelled
``splitspec.io/accelerator=prefill|draft|verify``, so each stage runs on its
own node and the KV crosses nodes through the object store, as on a real
multi-node cluster.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from deployments.config import (
    DEFAULT_APP_NAME, INGRESS, STAGE_LABEL, STAGES, AppConfig, Placement, labelled_placement, local_placement,
    resource_name,
)

logger = logging.getLogger(__name__)

DEFAULT_GRPC_PORT = 9000
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible HTTP API (Ray Serve's default HTTP port)
LOCAL_HOST = "127.0.0.1"
NODE_CPUS = 8  # logical CPUs per local node: replicas reserve 0; real cores are set by each stage's threads
OBJECT_STORE_BYTES = 512 * 2**20
APP_POLL_S = 0.5
MAX_GRPC_MESSAGE_BYTES = 4 * 2**20  # gRPC's own default: a larger request is RESOURCE_EXHAUSTED at the proxy


def ray_env() -> None:
    """Set what every Ray process we start must inherit (Ray 2.60 mixes token auth between nodes otherwise)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Serve's gRPC proxy takes messages up to 2 GiB by default: one call could make it hold gigabytes
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(MAX_GRPC_MESSAGE_BYTES))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Serve's proxy too routes on its own event loop, not one more thread (replicas: config.replica_one_loop)
    os.environ.setdefault("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "0")


def loopback_only() -> None:
    """Make a local cluster use 127.0.0.1 as its node address, so Ray's internal servers listen on loopback only.

    Ray turns an explicit ``_node_ip_address="127.0.0.1"`` into the machine's
    network address; it keeps loopback only where clusters are off — the
    setting it uses on macOS and Windows. Every process of the cluster inherits
    the variable; this process may have read it already when Ray was imported.
    What still listens on all interfaces is fixed in Ray 2.60's Serve: the gRPC
    proxy's port and each replica's inter-deployment gRPC server (README).
    """
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def store_stats(node_id: str):
    """A node's object store counters as its raylet reports them (bytes used, cumulative bytes created, ...)."""
    import ray
    from ray._private.internal_api import node_stats

    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False).store_stats


class PlacementError(RuntimeError):
    """Some stage cannot run on this cluster (its label or resource is on no node)."""

    def __init__(self, problems: dict[str, str]):
        self.problems = problems
        super().__init__("; ".join(problems.values()))


def local_gpus(config: AppConfig) -> int | None:
    """GPUs a one-node local cluster declares: torch's count where a stage runs on cuda (Ray counts through NVML,
    which some virtual machines do not offer: it would count none and leave every GPU stage unplaceable); else
    None (Ray counts). With no GPU torch can see, None too: the stage then fails at start, naming itself."""
    if not any(config.stage(stage).device.startswith("cuda") for stage in STAGES):
        return None
    import torch

    return torch.cuda.device_count() or None


class DeployError(RuntimeError):
    """The application failed to deploy: Serve gave up on a deployment (e.g. its replicas' constructor raised)."""


# errors of a replica's constructor that no retry fixes (a stage's device absent on its node): the deploy fails at the
# first, where Serve would start the replica again (3 times a replica) before it gave up
PERMANENT_STARTUP_ERRORS = ("DeviceUnavailableError",)


def _permanently_failing(deployment) -> bool:
    return deployment.status == "UPDATING" and any(f"{error}:" in (deployment.message or "")
                                                   for error in PERMANENT_STARTUP_ERRORS)


def _deploy_failure(name: str, status) -> DeployError:
    """The failed deployments with the last line of each one's error (Serve's app message only names them)."""
    reasons = [f"{deployment}: {_last_line(d.message)}" for deployment, d in status.deployments.items()
               if (d.status in ("DEPLOY_FAILED", "UNHEALTHY") or _permanently_failing(d)) and d.message]
    return DeployError(f"application {name!r} failed to deploy: {status.message}"
                       + "".join(f"\n  {reason}" for reason in reasons))


def _last_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def placements_for(nodes: int, config: AppConfig) -> AppConfig:
    """The config with every stage the config leaves unpinned pinned the way a local cluster of ``nodes`` offers.

    A local node carries both its stage's label and its stage's resource, so
    placements written in the config (labels or resources) are kept as they are.
    """
    data = config.model_dump()
    unset = Placement().model_dump()

    def pinned(placement: dict, where: Placement) -> dict:  # (a CPU set is kept: it pins within the node)
        if {**placement, "cpus": []} != unset:
            return placement
        return where.model_dump() | {"cpus": placement["cpus"]}

    for stage in STAGES:
        where = labelled_placement(stage) if nodes > 1 else local_placement(stage)
        data["stages"][stage]["placement"] = pinned(data["stages"][stage]["placement"], where)
    data["ingress_placement"] = pinned(data["ingress_placement"], local_placement(INGRESS))  # the head node
    return AppConfig.model_validate(data)


@dataclass
class LocalCluster:
    nodes: int = 1
    dashboard: bool = True
    metrics_export_port: int | None = None
    log_to_driver: bool = True  # replica logs on this process' stderr
    gpus: int | None = None  # nodes=1: GPUs the node declares (None: Ray counts the machine's; tests declare absent ones)
    _cluster: object = field(default=None, repr=False)
    dashboard_url: str = ""
    session_dir: str = ""  # Ray's session folder (logs under logs/); its name is in every Ray process of the cluster

    def start(self) -> "LocalCluster":
        import ray

        ray_env()
        loopback_only()
        if self.nodes not in (1, 3):
            raise ValueError("a local cluster has 1 node or 3 nodes (one per stage)")
        head = dict(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=self.dashboard,
                    dashboard_host=LOCAL_HOST)
        if self.metrics_export_port:
            head["metrics_export_port"] = self.metrics_export_port
        if self.nodes == 1:
            if self.gpus is not None:
                head["num_gpus"] = self.gpus
            # ("local": a cluster of its own, never the one another process started and named in
            # /tmp/ray/ray_current_cluster, as a 3-node local cluster does)
            context = ray.init("local", resources={resource_name(s): 1 for s in (*STAGES, INGRESS)},
                               log_to_driver=self.log_to_driver, **head)
        else:
            from ray.cluster_utils import Cluster

            head["resources"] = {resource_name(INGRESS): 1}
            self._cluster = Cluster(initialize_head=True, head_node_args=head)
            for stage in STAGES:
                self._cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE_BYTES,
                                       resources={resource_name(stage): 1}, labels={STAGE_LABEL: stage})
            context = ray.init(address=self._cluster.address, log_to_driver=self.log_to_driver)
        self.dashboard_url = context.dashboard_url or ""
        self.session_dir = context.address_info.get("session_dir", "")
        return self

    def stop(self) -> None:
        """Serve drains and stops (each replica within the app's graceful_shutdown_timeout_s), then Ray stops."""
        import ray
        from ray import serve

        start = time.monotonic()
        try:
            if ray.is_initialized():
                serve.shutdown()
        except Exception:  # noqa: BLE001 - stop Ray whatever Serve did
            logger.exception("Serve did not shut down cleanly; stopping Ray")
        finally:
            serve_s = time.monotonic() - start
            ray.shutdown()
            if self._cluster is not None:
                self._cluster.shutdown()
                self._cluster = None
            logger.info("stopped Serve in %.1fs, Ray in %.1fs", serve_s, time.monotonic() - start - serve_s)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_serve(grpc_port: int = DEFAULT_GRPC_PORT, http_port: int = 0, *, direct_ingress: bool = False,
                host: str = LOCAL_HOST) -> int | None:
    """Start Serve: splitspec's gRPC service on ``grpc_port`` and the OpenAI-compatible HTTP API on
    ``host``:``http_port`` (0: a free port, for benchmarks that do not use it), served by Serve's proxy. (Ray 2.60
    binds the gRPC port on all interfaces, whatever the host: splitspec.network.)

    ``direct_ingress``: the ingress replica serves both ports itself (Serve's direct ingress; deploy with
    ``config.direct_ingress``), so every token skips the proxy. Serve still starts its proxy on the head node (its
    controller insists), on free ports nobody is told of: returns that proxy's gRPC port, which Ray 2.60 binds on
    all interfaces like the proxy's port otherwise (README, "Network exposure"). One application, one ingress
    replica on this node: the controller hands each ingress replica a port from ``[port, port + 1)``."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from deployments.app import DIRECT_INGRESS_ENV, GRPC_SERVICERS

    options = {}
    proxy_grpc_port = None
    if direct_ingress:
        env = {**DIRECT_INGRESS_ENV,
               "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc_port),
               "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc_port + 1),  # (exclusive)
               "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
               "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + 1),
               # a restarted ingress replica gets its port back at once (Serve holds a released port for its
               # load balancer's sake otherwise, and there is only the one)
               "RAY_SERVE_PORT_QUARANTINE_S": "0"}
        options["controller_options"] = {"runtime_env": {"env_vars": env}}
        grpc_port = proxy_grpc_port = free_port()
        http_port = free_port()
    serve.start(
        proxy_location="HeadOnly",  # one proxy, on the head node: the gRPC port opens once
        http_options={"host": host, "port": http_port},
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICERS),
        **options,
    )
    return proxy_grpc_port


def serve_local(config: AppConfig, nodes: int, grpc_port: int, http_port: int, *,
                direct_ingress: bool | None = None) -> None:
    """On the local cluster just started with ``nodes`` nodes: start Serve and deploy ``config`` pinned for it and
    wait until it runs. ``direct_ingress``: the ingress replica serves the ports (start_serve); default: where it
    fits (direct_ingress_fits), as `splitspec serve` runs it."""
    direct = direct_ingress_fits(config) if direct_ingress is None else direct_ingress
    start_serve(grpc_port, http_port, direct_ingress=direct)
    deploy(placements_for(nodes, config.model_copy(update={"direct_ingress": direct})))


def direct_ingress_fits(config: AppConfig) -> bool:
    """Whether ``config`` runs with direct ingress on a local cluster (start_serve): not turned off
    (``direct_ingress: false``), and one ingress replica (all of a local cluster's share one node's ports)."""
    return config.direct_ingress is not False and config.ingress_replicas == 1


# Free ports come from below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default): Ray's own
# servers bind port 0 and get ephemeral ports, and one of them took a "free" port from that range before the proxy
# bound it ("Failed to bind to address [::]:46769").
FREE_PORTS = (20000, 32000)


def free_port() -> int:
    """A port nothing listens on, on any interface (Serve binds gRPC ports on [::]), outside the ephemeral range."""
    for _ in range(200):
        port = random.randrange(*FREE_PORTS)
        try:
            for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "127.0.0.1")):  # one after the other
                with socket.socket(family) as probe:
                    probe.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port in {FREE_PORTS}")


def deploy(config: AppConfig, *, name: str = DEFAULT_APP_NAME, route_prefix: str | None = "/", timeout_s: float = 600.0,
           stop: threading.Event | None = None) -> bool:
    """Deploy the app and wait until it runs (True) or ``stop`` is set (False); raise PlacementError naming any
    stage no node can host, DeployError naming each deployment that failed and why."""
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from deployments.app import build_app
    from deployments.placement import unplaceable

    serve.run_many([RunTarget(build_app(config.model_dump()), name=name, route_prefix=route_prefix)],
                   wait_for_applications_running=False)
    start = time.monotonic()
    while not (stop is not None and stop.is_set()):
        problems = unplaceable(config, ray.nodes())
        if problems and time.monotonic() - start >= min(config.placement_timeout_s, timeout_s):
            raise PlacementError(problems)
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return True
        if status is not None and (status.status == "DEPLOY_FAILED"
                                   or any(_permanently_failing(d) for d in status.deployments.values())):
            raise _deploy_failure(name, status)
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"application {name!r} not running after {timeout_s:g}s: {status.message if status else ''}")
        time.sleep(APP_POLL_S)
    return False


def leave(name: str = DEFAULT_APP_NAME) -> None:
    """On a cluster that is not ours: delete only our application (Serve and other apps stay), then disconnect."""
    import ray
    from ray import serve

    try:
        if ray.is_initialized():
            serve.delete(name, _blocking=True)
    finally:
        ray.shutdown()


def handle(deployment: str, app: str = DEFAULT_APP_NAME):
    """A handle to ``deployment`` that this driver (no event loop of its own) calls with ``.remote().result()``.

    ``ray_env`` makes Serve route on the caller's event loop (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0), which a
    synchronous driver does not have: its handles route on a loop of their own."""
    from ray import serve

    found = serve.get_deployment_handle(deployment, app)
    if not found.is_initialized:
        found._init(_run_router_in_separate_loop=True)
    return found
