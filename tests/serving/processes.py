"""`splitspec serve` as a child process in its own session: wait for its lines, stop it, and never leak its cluster.

Ray's processes are started by `splitspec serve` (or by its raylet) and stay in
its session even when they make their own process groups, so everything with
the serve process's session id is that cluster; ``ServeProcess`` ends all of it
on exit, whatever the test did.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from splitspec import network

BIN = Path(sys.executable).parent
SERVING = "is serving gRPC"


def session_processes(sid: int, session_name: str = "") -> list[psutil.Process]:
    """Live processes of a serve process's OS session, or whose command line names its Ray session."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or ())
            if os.getsid(proc.pid) == sid or (session_name and session_name in cmdline):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def listening_on(port: int) -> list:
    return [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


class ServeProcess:
    """``with ServeProcess(tmp_path, "--grpc-port", "9000") as serve: serve.wait_for(SERVING); serve.stop(SIGINT)``."""

    def __init__(self, log_dir: Path, *args: str, env: dict | None = None):
        from tests.serving.conftest import free_port

        self.log_path = log_dir / f"serve-{time.monotonic_ns()}.log"
        if "--http-port" not in args:  # not the default 8000: something else on the machine may hold it
            args = (*args, "--http-port", str(free_port()))
        self.args = [str(BIN / "splitspec"), "serve", "--no-dashboard", *args]
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServeProcess":
        from tests.serving.conftest import stop_shared_cluster

        stop_shared_cluster()  # (its cluster, and no other, on the machine)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    @property
    def session_name(self) -> str:
        """Ray's session name, from the `Ray session:` line or Ray's own start-up line."""
        found = re.search(r"(session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+)", self.log)
        return found.group(1) if found else ""

    def wait_for(self, text: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log:
            assert self.proc.poll() is None, f"splitspec serve exited ({self.proc.returncode}):\n{self.log[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s}s:\n{self.log[-3000:]}"
            time.sleep(0.2)

    def stop(self, sig: int, timeout_s: float) -> tuple[int | None, float]:
        """Send ``sig``; (exit code or None if still running after ``timeout_s``, seconds taken)."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - start

    def leftovers(self) -> list[psutil.Process]:
        return session_processes(self.proc.pid, self.session_name)

    def kill_all(self) -> None:
        """SIGKILL the serve process and every process of its session (a failing test leaks nothing)."""
        if self.proc is None:
            return
        procs = self.leftovers()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


# Ray 2.60's Serve binds these on all interfaces whatever the node address (splitspec.network):
# the gRPC proxy's port, and each replica's inter-deployment gRPC server ("[::]:0" in serve/_private/replica.py).
PROXY_PROCESS = "ray::ProxyActor"
REPLICA_PROCESS_PREFIX = "ray::ServeReplica"
INGRESS_PROCESS = "ray::ServeReplica:splitspec:SpecDecodeIngress"


def proxy_port(serve_log: str, grpc_port: int) -> int:
    """The gRPC port of Serve's proxy: ``grpc_port``, or with direct ingress the one `splitspec serve` printed (the
    ingress replica then serves ``grpc_port``)."""
    found = re.search(r"Serve's proxy, unused, on gRPC port (\d+)", serve_log)
    return int(found.group(1)) if found else grpc_port


def listeners(procs: list[psutil.Process], port: int) -> list[str]:
    """The names of the processes listening on ``port`` (any address), each process once."""
    return list({l.pid: l.process for l in network.listeners(procs) if l.port == port}.values())


def exposed_sockets(procs: list[psutil.Process], grpc_port: int) -> list[str]:
    """'name pid ip:port' of every listening socket beyond loopback, other than the two that Ray 2.60 fixes."""
    return [str(l) for l in network.listeners(procs) if l.beyond_loopback
            and not (l.process == PROXY_PROCESS and l.port == grpc_port) and not l.process.startswith(REPLICA_PROCESS_PREFIX)]


class OpenStream:
    """A long stream from `splitspec serve` on ``port``, read in a thread: ``wait_started`` until its first chunk,
    ``ended`` once it is over (finished, or with ``outcome["status"]``)."""

    def __init__(self, port: int, timeout_s: float):
        import threading

        self.port, self.timeout_s = port, timeout_s
        self.started, self.ended = threading.Event(), threading.Event()
        self.outcome: dict = {"chunks": 0}
        threading.Thread(target=self._consume, daemon=True).start()

    def _consume(self) -> None:
        import grpc

        from splitspec.api.client import SpecDecodeClient

        try:
            with SpecDecodeClient(f"127.0.0.1:{self.port}", timeout_s=self.timeout_s) as client:
                for _ in client.stream(messages=[("user", "Write a long story about a lighthouse keeper.")],
                                       max_new_tokens=400):
                    self.outcome["chunks"] += 1
                    self.started.set()
        except grpc.RpcError as exc:
            self.outcome["status"] = exc.code()
        finally:
            self.started.set()
            self.ended.set()

    def wait_started(self) -> None:
        """Until its first chunk; it must still be running then."""
        assert self.started.wait(self.timeout_s), "no chunk of the stream came"
        assert not self.ended.is_set(), f"the stream ended before the stop: {self.outcome}"
