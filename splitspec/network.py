"""What a local cluster actually listens on: every listening socket of its processes, and those beyond loopback.

`splitspec serve` prints this after it deploys (never the address it asked for: Ray 2.60's Serve binds its gRPC
ports on ``[::]`` whatever it is told — ``serve/_private/grpc_util.py`` for the service's port, ``replica.py`` for
each replica's inter-deployment server — and Ray offers no setting for it), and warns on every start when anything
listens beyond loopback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@dataclass(frozen=True)
class Listener:
    process: str  # the process's name (Ray's title: ray::ServeReplica:<app>:<deployment>, ray::ProxyActor, raylet ...)
    pid: int
    ip: str
    port: int

    @property
    def beyond_loopback(self) -> bool:
        return self.ip not in LOOPBACK

    @property
    def host(self) -> str:
        """The address as it is written before a port: [ip] for IPv6."""
        return f"[{self.ip}]" if ":" in self.ip else self.ip

    def __str__(self) -> str:
        return f"{self.host}:{self.port} ({self.process}, pid {self.pid})"


def cluster_processes(session_dir: str) -> list[psutil.Process]:
    """This process, its descendants, and every live process whose command line names the Ray session (a local
    cluster's raylets, workers and replicas, whatever process group they made)."""
    session = os.path.basename(session_dir.rstrip("/")) if session_dir else ""
    me = psutil.Process()
    found = {me.pid: me, **{p.pid: p for p in me.children(recursive=True)}}
    if session:
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if session in " ".join(proc.info["cmdline"] or ()):
                    found[proc.pid] = proc
            except psutil.Error:
                continue
    return list(found.values())


def listeners(procs: list[psutil.Process]) -> list[Listener]:
    """Every listening inet socket of ``procs``, sorted by port."""
    found = set()
    for proc in procs:
        try:
            name, conns = proc.name(), proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        found.update(Listener(name, proc.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN)
    return sorted(found, key=lambda listener: (listener.port, listener.ip))


def report(found: list[Listener], *, grpc_port: int, http_port: int, token: bool) -> tuple[list[str], list[str]]:
    """(lines for stdout, warnings for stderr): where the service's two ports are bound, and what else listens
    beyond loopback; a warning when anything does (stronger without a token)."""
    lines = []
    for what, port in (("gRPC", grpc_port), ("OpenAI HTTP", http_port)):
        bound = sorted({l.host for l in found if l.port == port})
        lines.append(f"{what} port {port} is bound on {', '.join(bound) or 'nothing yet'}")
    exposed = [l for l in found if l.beyond_loopback]
    others = [l for l in exposed if l.port not in (grpc_port, http_port)]
    if others:
        lines.append(f"{len(others)} more ports of the cluster listen beyond loopback (Ray Serve's gRPC servers):")
        lines += [f"  {l}" for l in others]
    warnings = []
    if exposed:
        ports = ", ".join(str(p) for p in sorted({l.port for l in exposed}))
        if token:
            warnings.append(f"warning: ports {ports} listen on all interfaces (Ray 2.60's Serve binds its gRPC servers "
                            "there whatever --host says); the service's calls need the token, but Serve's internal "
                            "gRPC servers do not check it: firewall these ports from other hosts")
        else:
            warnings.append(f"WARNING: ports {ports} listen on all interfaces with no authentication: anyone who "
                            "can reach this machine can call the service (Ray 2.60's Serve binds its gRPC servers "
                            "there whatever --host says). Set SPLITSPEC_AUTH_TOKEN or --auth-token-file, and "
                            "firewall these ports from other hosts")
    return lines, warnings
