"""The GPU check script runs everywhere: on a CPU-only machine it skips with a message, and its checks pass on the
CPU (the same code a GPU runs, less the device). Device handling: KV in bfloat16 survives the host payload, and
asking for a GPU that is not there is a clear error."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.hf_runner import ModelRunner
from services.loading import DeviceUnavailableError, check_device, wrap_model
from services.models.tiny import tiny_pair
from splitspec.checks import gpu as gpu_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run, not skip")
def test_script_skips_without_a_gpu():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], capture_output=True, text=True, timeout=120,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("SKIP: ") and "no CUDA GPU" in done.stdout


def test_checks_pass_on_the_cpu(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--pair", "tiny", "--draws", "600", "--json", str(tmp_path / "r.json")]) == 0
    assert "8/8 checks passed" in capsys.readouterr().out


def test_bfloat16_kv_survives_the_payload():
    target, _ = tiny_pair()
    runner = ModelRunner(wrap_model(target.model.to(torch.bfloat16), model_id="tiny-bf16", dtype="bfloat16"))
    cache = runner.new_cache()
    runner.forward(torch.tensor([1, 5, 7, 9]), cache)
    payload = cache.export(runner.loaded.fingerprint)
    assert payload.dtype == "bfloat16"
    imported = runner.import_payload(payload)
    assert imported.cache.layers[0].keys.dtype == torch.bfloat16
    assert torch.equal(runner.forward(torch.tensor([11]), cache), runner.forward(torch.tensor([11]), imported))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_missing_gpu_is_a_clear_error():
    with pytest.raises(DeviceUnavailableError, match="stage 'verify'.*no CUDA GPU"):
        check_device("cuda", where="stage 'verify', node abc")
    assert check_device("cpu").type == "cpu"
