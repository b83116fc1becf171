"""`splitspec serve` prints its addresses, `splitspec generate` streams an answer through it, its OpenAI API answers
on --http-port, Ctrl-C stops it cleanly while a stream is open (the stream ends)."""

import os
import signal
import subprocess

import httpx2 as httpx
import pytest

from splitspec.stopping import DEFAULT_STOP_TIMEOUT_S
from tests.serving.conftest import free_port
from tests.serving.processes import BIN, OpenStream, ServeProcess, exposed_sockets, listening_on, proxy_port

pytestmark = pytest.mark.slow



def test_serve_generate_ctrl_c(tmp_path):
    port, http_port = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with ServeProcess(tmp_path, "--grpc-port", str(port), "--http-port", str(http_port)) as serve:
        serve.wait_for("Ctrl-C stops it.")  # (after the lines of what it bound)
        assert f"serving gRPC on port {port}" in serve.log and "Ray session: " in serve.log
        assert f"OpenAI-compatible API on http://127.0.0.1:{http_port}/v1" in serve.log
        assert f"gRPC port {port} is bound on [::]" in serve.log  # what Ray 2.60 binds, said truly
        answer = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
            "temperature": 0})
        assert answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["message"]["content"]
        # Ray's own servers listen on loopback only; the ingress replica serves the port (direct ingress)
        assert exposed_sockets(serve.leftovers(), proxy_port(serve.log, port)) == []
        assert "direct ingress" in serve.log and listening_on(port)
        out = subprocess.run([BIN / "splitspec", "generate", "What is the capital of France?", "--address",
                              f"127.0.0.1:{port}", "--max-new-tokens", "16", "--k", "2"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout and "drafter hybrid, k=2" in out.stdout  # the default pair ships an EAGLE head: the hybrid is the server default
        bad = subprocess.run([BIN / "splitspec", "generate", "hi", "--address", f"127.0.0.1:{port}", "--temperature", "-1"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
        # the readiness probe of the KubeRay manifest: healthy here; not for an app it does not serve
        health = subprocess.run([BIN / "splitspec", "health", "--address", f"127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=60, env=env)
        assert health.returncode == 0 and "application 'splitspec' is SERVING" in health.stdout, health.stderr
        other = subprocess.run([BIN / "splitspec", "health", "--address", f"127.0.0.1:{port}", "--app-name", "nope"],
                               capture_output=True, text=True, timeout=60, env=env)
        assert other.returncode == 1 and "not 'nope'" in other.stderr
        stream = OpenStream(port, DEFAULT_STOP_TIMEOUT_S * 2)  # Ctrl-C while a stream is open
        stream.wait_started()
        code, took = serve.stop(signal.SIGINT, DEFAULT_STOP_TIMEOUT_S + 10)
        assert code == 0, f"exit {code} after {took:.1f}s:\n{serve.log[-3000:]}"
        assert stream.ended.wait(DEFAULT_STOP_TIMEOUT_S), "the open stream never ended"
        assert "stopping" in serve.log and "stopped." in serve.log
        assert not serve.leftovers() and not listening_on(port) and not listening_on(http_port)
        gone = subprocess.run([BIN / "splitspec", "health", "--address", f"127.0.0.1:{port}", "--timeout", "2"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert gone.returncode == 1 and "unhealthy: UNAVAILABLE" in gone.stderr
