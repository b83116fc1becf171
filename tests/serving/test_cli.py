"""`splitspec serve` prints its addresses, `splitspec generate` streams an answer through it, Ctrl-C stops it cleanly."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serving.conftest import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def test_serve_generate_ctrl_c(tmp_path):
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen([BIN / "splitspec", "serve", "--grpc-port", str(port), "--no-dashboard"],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while "is serving gRPC" not in (tmp_path / "serve.log").read_text():
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "splitspec serve did not come up"
            time.sleep(1)
        assert f"127.0.0.1:{port}" in (tmp_path / "serve.log").read_text()
        out = subprocess.run([BIN / "splitspec", "generate", "What is the capital of France?", "--address",
                              f"127.0.0.1:{port}", "--max-new-tokens", "16", "--k", "2"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout and "drafter model, k=2" in out.stdout
        bad = subprocess.run([BIN / "splitspec", "generate", "hi", "--address", f"127.0.0.1:{port}", "--temperature", "-1"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        code = serve.wait(timeout=120)
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert "stopping" in (tmp_path / "serve.log").read_text()
