"""`splitspec serve` always stops within its bound on Ctrl-C / SIGTERM — during start-up, while serving, during an
open stream, on 1 node and on 3 — and leaves no process of its Ray session and no listening port behind; on 3 nodes
Ray's own traffic stays on loopback."""

import signal

import pytest

from splitspec import network
from splitspec.stopping import FORCED_EXIT_CODE
from splitspec.cli import STARTING
from tests.serving.conftest import free_port, stop_shared_cluster, until
from tests.serving.processes import (
    INGRESS_PROCESS, PROXY_PROCESS, REPLICA_PROCESS_PREFIX, SERVING, OpenStream, ServeProcess, exposed_sockets,
    listeners, listening_on, proxy_port,
)

pytestmark = pytest.mark.slow

STOP_TIMEOUT_S = 30  # the bound under test (`--stop-timeout`, also the default)
EXIT_MARGIN_S = 10  # beyond the bound, only for a forced stop to finish killing
# SIGINT and SIGTERM reach one handler (splitspec.stopping.STOP_SIGNALS), so each scenario runs each signal and
# each node count once, pairwise, instead of the full 2 x 2 (four serve starts less: about 4 minutes of the suite);
# the open stream on 1 node with SIGINT is test_cli.py's, on 3 nodes with SIGTERM here (with the checks that Ray listens on loopback).
# Start-up has three points to stop at (0: Ray not up yet, 1: the app deploying, 2: replicas loading their models),
# dealt over the two cases (a serve start each: about 25 s).
START_UP_CASES = [(signal.SIGINT, 1), (signal.SIGTERM, 3)]
START_UP_POINTS = {1: (0, 2), 3: (1,)}  # nodes -> points


def case_id(case) -> str:
    return f"{signal.Signals(case[0]).name}-{case[1]}"


def serve(tmp_path, port: int, nodes: int, *extra: str) -> ServeProcess:
    return ServeProcess(tmp_path, "--grpc-port", str(port), "--nodes", str(nodes), "--stop-timeout", str(STOP_TIMEOUT_S),
                        *extra)


def assert_stopped_cleanly(proc: ServeProcess, sig: int, port: int) -> float:
    code, took = proc.stop(sig, STOP_TIMEOUT_S + EXIT_MARGIN_S)
    assert code is not None, f"still running {took:.0f}s after {signal.Signals(sig).name}:\n{proc.log[-3000:]}"
    assert code == 0, f"exit {code} after {took:.1f}s (a forced stop means the graceful one hung):\n{proc.log[-3000:]}"
    assert "stopped." in proc.log
    left = proc.leftovers()
    assert not left, f"left behind: {[(p.pid, p.name()) for p in left]}"
    assert not listening_on(port), "the gRPC port is still listening"
    return took


@pytest.mark.parametrize("sig,nodes", START_UP_CASES, ids=map(case_id, START_UP_CASES))
def test_stop_during_start_up(tmp_path, nodes, sig):
    """Stops at successive points of start-up: Ray starting, the app deploying, replicas loading their models."""
    port = free_port()
    for i in START_UP_POINTS[nodes]:
        with serve(tmp_path, port, nodes) as proc:
            if i == 0:
                proc.wait_for(STARTING)  # its stop is handled; Ray is not up yet
            else:
                proc.wait_for("deploying")
                if i == 2:  # a replica's process is up: replicas are starting / loading models
                    until("a replica started", lambda: any(p.name().startswith(REPLICA_PROCESS_PREFIX)
                                                           for p in proc.leftovers()))
            assert_stopped_cleanly(proc, sig, port)


def test_three_nodes_listen_on_loopback_and_stop_during_an_open_stream(tmp_path):
    """`serve --nodes 3`: Ray's internal traffic stays on loopback (nothing listens beyond 127.0.0.1 but what Ray
    2.60's Serve fixes: the gRPC proxy's port, each replica's gRPC servers: the inter-deployment one and, with direct
    ingress, the service's port), and `splitspec serve` prints every one of those, the replicas' too, and warns that
    they listen beyond loopback without a token. Then SIGTERM while a stream is open: the stream ends (finished or
    with a status), the service stops within the bound. (1 node, SIGINT during a stream: test_cli.py.)"""
    port, http_port = free_port(), free_port()
    with ServeProcess(tmp_path, "--grpc-port", str(port), "--http-port", str(http_port), "--nodes", "3",
                      "--stop-timeout", str(STOP_TIMEOUT_S)) as proc:
        proc.wait_for(SERVING)
        proc.wait_for("Ctrl-C stops it.")  # (after the lines of what it bound)
        procs = proc.leftovers()  # every process of the session, while it runs
        names = [p.name() for p in procs]
        assert sum(n == "raylet" for n in names) == 4, names  # head + prefill / draft / verify nodes
        assert names.count(PROXY_PROCESS) == 1, names  # one proxy (head node): the gRPC port opens once
        # the ingress replica serves the port (direct ingress); Serve's proxy has one of its own beside it
        assert exposed_sockets(procs, proxy_port(proc.log, port)) == []
        owners = listeners(procs, port)  # (Ray's process title may carry the method running: ".GenerateStream")
        assert len(owners) == 1 and owners[0].startswith(INGRESS_PROCESS), owners
        # what it printed is what listens: every socket beyond loopback, the replicas' included, and the warning
        exposed = [line for line in network.listeners(procs) if line.beyond_loopback]
        assert any(p.process.startswith(REPLICA_PROCESS_PREFIX) and p.port != port for p in exposed), exposed
        log = proc.log
        assert f"gRPC port {port} is bound on [::]" in log, log[-3000:]
        assert f"OpenAI HTTP port {http_port} is bound on 127.0.0.1\n" in log, log[-3000:]
        for listener in exposed:
            assert f":{listener.port} (" in log or listener.port == port, (str(listener), log[-3000:])
        assert "WARNING: ports" in log and "with no authentication" in log
        stream = OpenStream(port, STOP_TIMEOUT_S * 2)
        stream.wait_started()
        assert_stopped_cleanly(proc, signal.SIGTERM, port)
        assert stream.ended.wait(STOP_TIMEOUT_S), "the open stream never ended"


def test_second_ctrl_c_forces_the_stop(tmp_path):
    """Ctrl-C twice: the stop is forced at once, and still nothing of the session is left."""
    port = free_port()
    with serve(tmp_path, port, 1) as proc:
        proc.wait_for("deploying")
        proc.proc.send_signal(signal.SIGINT)
        proc.wait_for("stopping (SIGINT received)")  # the first one is handled: the second one forces the stop
        code, _ = proc.stop(signal.SIGINT, STOP_TIMEOUT_S)
        assert code == FORCED_EXIT_CODE, proc.log[-3000:]
        # forced by the second signal itself, not by the bound running out (no wall-clock assertion needed)
        assert "forcing the stop: SIGINT received again" in proc.log, proc.log[-3000:]
        assert "not stopped after" not in proc.log
        until("every process of the session gone (SIGKILLed ones reaped)", lambda: not proc.leftovers(), bound_s=30)


def test_address_mode_leaves_the_cluster_running(tmp_path):
    """`serve --address` on a cluster that is not its own: the stop deletes only its app; the cluster and Serve stay."""
    import ray
    from ray import serve as ray_serve

    from splitspec import cluster

    stop_shared_cluster()
    local = cluster.LocalCluster(nodes=1, dashboard=False, log_to_driver=False).start()
    try:
        address = ray.get_runtime_context().gcs_address
        port = free_port()
        with ServeProcess(tmp_path, "--address", address, "--grpc-port", str(port), "--stop-timeout",
                          str(STOP_TIMEOUT_S)) as proc:
            proc.wait_for(SERVING)
            code, took = proc.stop(signal.SIGTERM, STOP_TIMEOUT_S + EXIT_MARGIN_S)
            assert code == 0, proc.log[-3000:]
        assert all(n["Alive"] for n in ray.nodes()), "a node of the existing cluster went down"
        assert "splitspec" not in ray_serve.status().applications
        assert ray.get(ray.remote(lambda: 42).remote(), timeout=60) == 42  # the cluster still runs work
    finally:
        local.stop()
