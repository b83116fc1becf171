"""The KubeRay RayService manifest (deployments/kuberay/rayservice.yaml): a RayService for this Ray, whose Serve
config validates and names the servicer, whose worker groups can host every stage, with a readiness probe that
runs `splitspec health`."""

from pathlib import Path

import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import GRPC_SERVICERS, build_app
from deployments.config import STAGES, AppConfig
from deployments.placement import unplaceable
from splitspec.cli import build_parser

MANIFEST = Path(__file__).resolve().parents[2] / "deployments" / "kuberay" / "rayservice.yaml"


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _app_args() -> dict:
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(_manifest()["spec"]["serveConfigV2"]))
    (app,) = serve_config.applications
    return app.args


def _groups() -> dict[str, dict]:
    cluster = _manifest()["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster["workerGroupSpecs"]}


def _as_node(group: dict) -> dict:
    """The Ray node a pod of ``group`` starts (what ray.nodes() would list): its labels, CPUs and GPUs."""
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    return {"Alive": True, "Labels": dict(group.get("labels", {})),
            "Resources": {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}}


def test_a_rayservice_for_this_ray():
    manifest = _manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__


def test_serve_config_validates_and_names_the_servicer():
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(_manifest()["spec"]["serveConfigV2"]))
    assert serve_config.grpc_options.grpc_servicer_functions == GRPC_SERVICERS
    (app,) = serve_config.applications
    assert app.import_path == "deployments.app:build_app"
    AppConfig.model_validate(app.args)
    build_app(app.args)  # the graph binds


def test_every_stage_can_be_placed_and_each_on_its_own_group():
    config = AppConfig.model_validate(_app_args())
    groups = _groups()
    assert unplaceable(config, [_as_node(g) for g in groups.values()]) == {}
    for stage in STAGES:  # exactly one group fits each stage: the stages do not share pods
        fits = [name for name, g in groups.items() if not unplaceable(config, [_as_node(g)]).get(stage)]
        assert fits == [stage], (stage, fits)


def test_every_pod_mounts_the_models_where_the_config_reads_them():
    models = AppConfig.model_validate(_app_args()).models
    for name, group in _groups().items():
        (container,) = group["template"]["spec"]["containers"]
        mounts = [m["mountPath"] for m in container.get("volumeMounts", ())]
        assert any(models.target.startswith(m) and models.draft.startswith(m) for m in mounts), name


def test_readiness_probe_runs_splitspec_health_on_the_grpc_port():
    (head,) = _groups()["head"]["template"]["spec"]["containers"]
    command = head["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["splitspec", "health"]
    args = build_parser().parse_args(command[1:])
    assert args.fn.__name__ == "cmd_health"
    grpc_port = yaml.safe_load(_manifest()["spec"]["serveConfigV2"])["grpc_options"]["port"]
    assert args.address.endswith(f":{grpc_port}") and {"containerPort": grpc_port, "name": "grpc"} in head["ports"]


def test_the_head_exposes_the_openai_api_on_the_serve_port():
    (head,) = _groups()["head"]["template"]["spec"]["containers"]
    http = yaml.safe_load(_manifest()["spec"]["serveConfigV2"])["http_options"]
    assert http["host"] == "0.0.0.0"  # in a pod: reachable through the Service (and kubectl port-forward)
    assert {"containerPort": http["port"], "name": "serve"} in head["ports"]  # KubeRay's serve Service targets it
