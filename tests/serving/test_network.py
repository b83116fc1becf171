"""A local cluster keeps Ray's internal traffic on loopback: nothing of it listens beyond 127.0.0.1 except what Ray
2.60's Serve fixes (the gRPC proxy's port, each replica's gRPC servers: the inter-deployment one and, with direct
ingress, the service's port), on 1 node and on 3. `splitspec serve` prints every one of those, the replicas' too,
and warns that they listen beyond loopback without a token."""

import signal

import pytest

from tests.serving.conftest import free_port
from splitspec import network
from tests.serving.processes import (
    INGRESS_PROCESS, PROXY_PROCESS, REPLICA_PROCESS_PREFIX, SERVING, ServeProcess, exposed_sockets, listeners,
    proxy_port,
)

pytestmark = pytest.mark.slow


def test_three_node_cluster_listens_on_loopback_only(tmp_path):
    port, http_port = free_port(), free_port()
    with ServeProcess(tmp_path, "--grpc-port", str(port), "--http-port", str(http_port), "--nodes", "3") as serve:
        serve.wait_for(SERVING)
        serve.wait_for("Ctrl-C stops it.")  # (after the lines of what it bound)
        procs = serve.leftovers()  # every process of the session, while it runs
        names = [p.name() for p in procs]
        assert sum(n == "raylet" for n in names) == 4, names  # head + prefill / draft / verify nodes
        assert names.count(PROXY_PROCESS) == 1, names  # one proxy (head node): the gRPC port opens once
        # the ingress replica serves the port (direct ingress); Serve's proxy has one of its own beside it
        assert exposed_sockets(procs, proxy_port(serve.log, port)) == []
        owners = listeners(procs, port)  # (Ray's process title may carry the method running: ".GenerateStream")
        assert len(owners) == 1 and owners[0].startswith(INGRESS_PROCESS), owners
        # what it printed is what listens: every socket beyond loopback, the replicas' included, and the warning
        exposed = [line for line in network.listeners(procs) if line.beyond_loopback]
        assert any(l.process.startswith(REPLICA_PROCESS_PREFIX) and l.port != port for l in exposed), exposed
        log = serve.log
        assert f"gRPC port {port} is bound on [::]" in log, log[-3000:]
        assert f"OpenAI HTTP port {http_port} is bound on 127.0.0.1\n" in log, log[-3000:]
        for listener in exposed:
            assert f":{listener.port} (" in log or listener.port == port, (str(listener), log[-3000:])
        assert "WARNING: ports" in log and "with no authentication" in log
        code, _ = serve.stop(signal.SIGTERM, 40)
        assert code == 0, serve.log[-3000:]
