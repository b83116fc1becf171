"""The GPU serve check (scripts/gpu-serve-check.sh) runs everywhere: on a CPU-only machine it skips with a message,
and with --device cpu it deploys configs/gpu-one.yaml's graph (its cuda stages moved to the CPU) through the real
`splitspec serve` with a random-weight pair around the default tokenizer, and every check passes. The GPU run
itself needs a GPU session (README, "On GPU nodes")."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deployments.config import AppConfig
from splitspec.checks import gpu_serve as gpu_serve_check
from splitspec.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # the tokenizer is the prepared default pair's


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run, not skip")
def test_script_skips_without_a_gpu():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-serve-check.sh")], capture_output=True, text=True,
                          timeout=120, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("SKIP: ") and "no CUDA GPU" in done.stdout


def test_the_configs_stages_are_on_the_gpu_and_the_mixed_run_drafts_on_the_cpu(tmp_path):
    pair = (tmp_path / "target", tmp_path / "draft")
    one = gpu_serve_check.run_config("one-gpu", pair, "cuda")
    assert {s["device"] for s in one["stages"].values()} == {"cuda"}
    assert sum(s["placement"]["num_gpus"] for s in one["stages"].values()) <= 1  # they share one GPU
    mixed = gpu_serve_check.run_config("mixed", pair, "cuda")
    assert mixed["stages"]["draft"]["device"] == "cpu" and mixed["stages"]["draft"]["placement"]["num_gpus"] == 0
    assert mixed["stages"]["verify"]["device"] == "cuda" and mixed["speculation"]["drafting"] == "remote"
    for config in (one, mixed, gpu_serve_check.run_config("mixed", pair, "cpu")):
        AppConfig.model_validate(config)
    with pytest.raises(SystemExit):  # argparse: an unknown run is refused before anything is built or served
        gpu_serve_check.main(["--device", "cpu", "--runs", "one-gpu,three-gpus"])


def test_the_one_gpu_graph_serves_on_the_cpu(tmp_path, capsys):
    code = gpu_serve_check.main(["--device", "cpu", "--runs", "one-gpu", "--max-new-tokens", "16",
                                 "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "8/8 serve checks passed" in out
    run = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert run["run"] == "one-gpu" and all(c["ok"] for c in run["checks"])
    assert run["model k=3"]["drafted"] > 0  # it did speculate


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_stage_where_torch_sees_no_gpu_fails_the_deploy_naming_stage_and_node():
    """Ray is told the node has a GPU (it places the replica), torch in the replica sees none: the deploy fails with
    the replica's error, which names the stage and the node, instead of serving on the CPU or hanging."""
    from ray import serve

    from splitspec import cluster
    from tests.serving.conftest import make_config, shared_cluster

    config = make_config(stages={"verify": {"device": "cuda", "placement": {"num_gpus": 0.3}}})
    shared_cluster()  # (its node declares a GPU)
    try:
        with pytest.raises(cluster.DeployError, match="failed to deploy") as failed:
            cluster.serve_local(config, 1, free_port(), free_port())
    finally:
        serve.shutdown()
    assert "Verify: " in str(failed.value) and "stage 'verify', node " in str(failed.value)
    assert "torch sees no CUDA GPU" in str(failed.value)
