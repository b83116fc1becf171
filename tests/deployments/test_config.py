"""The app config validates on its first line; the shipped YAML files are valid Serve configs."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.app import GRPC_SERVICER, build_app
from deployments.config import AppConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["default.yaml", "cluster.yaml"])
def test_shipped_configs_validate(name):
    data = yaml.safe_load((CONFIGS / name).read_text())
    schema = ServeDeploySchema.model_validate(data)
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER]
    app = schema.applications[0]
    assert app.import_path == "deployments.app:build_app"
    AppConfig.model_validate(app.args)


@pytest.mark.parametrize("bad", [
    {"speculation": {"drafter": "oracle"}},
    {"speculation": {"num_draft_tokens": -1}},  # 0 is valid: adaptive k
    {"speculation": {"max_draft_tokens": 0}},
    {"stages": {"verify": {"num_replicas": 0}}},
    {"limits": {"max_new_tokens": 8, "default_max_new_tokens": 16}},
    {"unknown_field": 1},
])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValidationError):
        build_app(bad)
