"""The app config validates on its first line; the shipped YAML files are valid Serve configs."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.app import GRPC_SERVICERS, build_app
from deployments.config import AppConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["default.yaml", "cluster.yaml", "gpu.yaml", "gpu-one.yaml"])
def test_shipped_configs_validate(name):
    data = yaml.safe_load((CONFIGS / name).read_text())
    schema = ServeDeploySchema.model_validate(data)
    assert schema.grpc_options.grpc_servicer_functions == GRPC_SERVICERS
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
    {"stages": {"verify": {"device": "tpu"}}},
    {"stages": {"verify": {"device": "cuda"}}},  # no GPU in its placement: Ray would hide the GPUs from it
    {"stages": {"verify": {"dtype": "bfloat16"}}},  # prefill stays float32: the KV could not pass between them
    {"stages": {"draft": {"dtype": "int4"}}},
    {"limits": {"request_timeout_s": 60, "session_idle_s": 60}},  # a live request's sessions could be closed
    {"speculation": {"drafting": "elsewhere"}},
    {"models": {"drafter_modules": ["no_such_module_here"]}},  # a drafter kind's module that cannot be imported
    {"stages": {"prefill": {"kv_capacity": 1024}}},  # only the verify stage holds sessions
    {"stages": {"verify": {"kv_capacity": -1}}},
    {"stages": {"draft": {"pass_slots": 4}}},
    {"stages": {"verify": {"pass_slots": 65}}},
])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValidationError):
        build_app(bad)


def test_gpu_stage_options():
    from deployments.app import actor_options

    config = AppConfig.model_validate({"stages": {s: {"device": "cuda", "dtype": "bfloat16", "placement": {"num_gpus": 1}}
                                                  for s in ("prefill", "verify")}})
    assert config.stage_dtype("verify") == "bfloat16" and config.stage_dtype("draft") == "float32"
    assert actor_options(config.stage("verify").placement)["num_gpus"] == 1
    assert "num_gpus" not in actor_options(config.stage("draft").placement)


def test_kv_capacity_bounds_the_context():
    assert AppConfig().context_limit(8192) == 8192  # 0: the target's context
    config = AppConfig.model_validate({"stages": {"verify": {"kv_capacity": 2048}}})
    assert config.context_limit(8192) == 2048 and config.context_limit(512) == 512


@pytest.mark.parametrize("access_log", [False, True])
def test_stage_access_log(access_log):
    """Serve's access log line per stage call is off unless asked for (hundreds a second under load); the ingress's
    per-request log is Serve's default either way."""
    ingress = build_app({"stage_access_log": access_log})._bound_deployment
    stages = [arg._bound_deployment for arg in ingress.init_args[1:]]
    assert [d.name for d in stages] == ["Prefill", "Verify"]  # (no draft stage: requests draft locally here)
    assert all(d._deployment_config.logging_config["enable_access_log"] is access_log for d in stages)
    assert (ingress._deployment_config.logging_config or {}).get("enable_access_log", True) is True


@pytest.mark.parametrize("one_loop", [True, False])
def test_replica_one_loop(one_loop):
    """Every replica (the ingress too) runs its methods and its handles' router on its own event loop unless the
    config says otherwise: Serve reads the two variables in the replica's process, from its runtime_env."""
    ingress = build_app({"replica_one_loop": one_loop})._bound_deployment
    replicas = [ingress] + [arg._bound_deployment for arg in ingress.init_args[1:]]
    expected = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0" if one_loop else "1",
                "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0" if one_loop else "1"}
    assert [d.ray_actor_options["runtime_env"]["env_vars"] for d in replicas] == [expected] * 3
    assert AppConfig().replica_one_loop is True


@pytest.mark.parametrize("direct", [None, False, True])
def test_direct_ingress(direct):
    """The ingress replica (only it) gets Serve's direct-ingress flag in its runtime_env when the config turns it on;
    `splitspec serve` and the tests' local clusters turn it on where it fits (one ingress replica, not switched off)."""
    from splitspec.cluster import direct_ingress_fits

    ingress = build_app({"direct_ingress": direct})._bound_deployment
    stages = [arg._bound_deployment for arg in ingress.init_args[1:]]
    env = ingress.ray_actor_options["runtime_env"]["env_vars"]
    assert (env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1") is bool(direct)
    assert all("RAY_SERVE_ENABLE_DIRECT_INGRESS" not in d.ray_actor_options["runtime_env"]["env_vars"] for d in stages)
    assert direct_ingress_fits(AppConfig.model_validate({"direct_ingress": direct})) is (direct is not False)
    assert not direct_ingress_fits(AppConfig.model_validate({"direct_ingress": direct, "ingress_replicas": 2}))


@pytest.mark.parametrize("draft,verify,remote", [
    ({}, {}, False),  # one machine, nothing pinned: the verify replica drafts
    ({"placement": {"resources": {"splitspec_draft": 0.01}}}, {"placement": {"resources": {"splitspec_verify": 0.01}}},
     False),  # custom resources alone (a local cluster's) say nothing of the hardware
    ({"placement": {"label_selector": {"a": "draft"}}}, {"placement": {"label_selector": {"a": "verify"}}}, True),
    ({"placement": {"label_selector": {"a": "x"}}}, {"placement": {"label_selector": {"a": "x"}}}, False),
    ({"device": "cuda", "placement": {"num_gpus": 1}}, {"device": "cuda", "placement": {"num_gpus": 1}}, True),
    ({"device": "cuda", "placement": {"num_gpus": 0.5}}, {"device": "cuda", "placement": {"num_gpus": 0.5}}, False),
    ({}, {"device": "cuda", "placement": {"num_gpus": 1}}, True),  # the drafter on the CPU, the target on a GPU
    ({"placement": {"cpus": [0]}}, {"placement": {"cpus": [1]}}, True),  # a core of its own
    ({"placement": {"cpus": [0, 1]}}, {"placement": {"cpus": [1]}}, False),
    ({"placement": {"cpus": [0]}}, {}, False),  # verify may run anywhere, on CPU 0 too
])
def test_drafting_is_placed_by_hardware(draft, verify, remote):
    """speculation.drafting auto: remote where the draft stage has a device of its own; the draft stage is deployed
    only then. local / remote force it."""
    config = AppConfig.model_validate({"stages": {"draft": draft, "verify": verify}})
    assert config.remote_drafting() is remote
    assert ("draft" in config.deployed_stages()) is remote
    for forced in ("local", "remote"):
        data = config.model_dump() | {"speculation": {"drafting": forced}}
        assert AppConfig.model_validate(data).remote_drafting() is (forced == "remote")
    names = [arg._bound_deployment.name for arg in build_app(config.model_dump())._bound_deployment.init_args[1:]]
    assert names == ["Prefill", "Verify"]  # (the draft stage, where deployed, is bound to Verify)


def test_engine_nice_defaults_and_bounds():
    """Engine threads stay as Ray starts workers unless a stage sets its niceness (None: no call)."""
    config = AppConfig()
    assert [config.stage(name).engine_nice for name in ("verify", "prefill", "draft")] == [None] * 3
    assert AppConfig.model_validate({"stages": {"verify": {"engine_nice": 0}}}).stage("verify").engine_nice == 0
    with pytest.raises(ValidationError, match="engine_nice"):
        AppConfig.model_validate({"stages": {"verify": {"engine_nice": 25}}})


def test_saturated_niceness_defaults_and_bounds():
    """Every stage's engine thread goes to nice 0 from passes of 16 calls on, unless its config says otherwise."""
    config = AppConfig()
    assert [(config.stage(name).saturated_nice, config.stage(name).saturated_calls)
            for name in ("verify", "prefill", "draft")] == [(0, 16)] * 3
    custom = AppConfig.model_validate({"stages": {"verify": {"saturated_nice": None, "saturated_calls": 4}}})
    assert (custom.stage("verify").saturated_nice, custom.stage("verify").saturated_calls) == (None, 4)
    for bad in ({"saturated_nice": -21}, {"saturated_calls": 0}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            AppConfig.model_validate({"stages": {"verify": bad}})


def test_engine_thread_without_the_right_to_its_niceness_logs_and_goes_on(monkeypatch, caplog):
    import os

    from deployments import priority, stages

    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    with caplog.at_level("WARNING", logger=priority.logger.name):  # (deployments.priority.set_thread_nice logs it)
        stages._engine_thread(0)
    assert "CAP_SYS_NICE" in caplog.text
    stages._engine_thread(None)  # (nothing to set: no call)
