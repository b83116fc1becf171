"""Unplaceable stages are named with the missing label or resource; placeable ones are not."""

from deployments.config import AppConfig
from deployments.placement import unplaceable
from splitspec.cluster import placements_for


def _node(labels=None, resources=None, alive=True):
    return {"Alive": alive, "Labels": labels or {}, "Resources": {"CPU": 8, **(resources or {})}}


def test_local_layout_places_every_stage():
    config = placements_for(1, AppConfig())
    assert unplaceable(config, [_node(resources={f"splitspec_{s}": 1 for s in ("prefill", "draft", "verify", "ingress")})]) == {}


def test_missing_label_names_stage_and_label():
    config = placements_for(3, AppConfig())
    nodes = [_node({"splitspec.io/accelerator": "prefill"}, {"splitspec_ingress": 1}), _node({"splitspec.io/accelerator": "draft"}),
             _node({"splitspec.io/accelerator": "verify"}, alive=False)]
    problems = unplaceable(config, nodes)
    assert list(problems) == ["verify"]
    assert "'verify'" in problems["verify"] and "splitspec.io/accelerator=verify" in problems["verify"]


def test_missing_resource_and_selector_syntax():
    data = AppConfig().model_dump()
    data["stages"]["draft"]["placement"] = {"resources": {"tpu_like": 1}}
    data["stages"]["prefill"]["placement"] = {"label_selector": {"zone": "in(a,b)"}}
    data["stages"]["verify"]["placement"] = {"label_selector": {"zone": "!a"}}
    problems = unplaceable(AppConfig.model_validate(data), [_node({"zone": "a"})])  # the ingress goes anywhere
    assert set(problems) == {"verify"}  # (drafting local: the draft stage is not deployed, nothing to place)
    data["speculation"]["drafting"] = "remote"
    problems = unplaceable(AppConfig.model_validate(data), [_node({"zone": "a"})])
    assert set(problems) == {"draft", "verify"} and "tpu_like" in problems["draft"]


def test_local_cluster_fills_only_unset_placements():
    """Placement written in a config stays as written; `splitspec serve` pins only what the config leaves open."""
    data = AppConfig().model_dump()
    data["stages"]["verify"]["placement"] = {"label_selector": {"splitspec.io/accelerator": "verify"}}
    config = placements_for(1, AppConfig.model_validate(data))
    assert config.stages.verify.placement.label_selector == {"splitspec.io/accelerator": "verify"}
    assert config.stages.verify.placement.resources == {}
    assert config.stages.draft.placement.resources == {"splitspec_draft": 0.01}
    assert config.ingress_placement.resources == {"splitspec_ingress": 0.01}
    assert placements_for(3, AppConfig()).stages.prefill.placement.label_selector == {"splitspec.io/accelerator": "prefill"}


def test_gpu_stage_without_gpu_nodes_is_named():
    config = placements_for(1, AppConfig.model_validate(
        {"stages": {"verify": {"device": "cuda", "placement": {"num_gpus": 1}}}}))
    node = _node(resources={f"splitspec_{s}": 1 for s in ("prefill", "draft", "verify", "ingress")})
    problems = unplaceable(config, [node])
    assert list(problems) == ["verify"] and "GPU" in problems["verify"]
    assert unplaceable(config, [{**node, "Resources": {**node["Resources"], "GPU": 1}}]) == {}


def test_a_local_node_declares_no_gpus_torch_cannot_see():
    import torch

    from splitspec.cluster import local_gpus

    assert local_gpus(AppConfig()) is None  # Ray counts (and no stage asks for a GPU)
    cuda = AppConfig.model_validate({"stages": {"verify": {"device": "cuda", "placement": {"num_gpus": 1}}}})
    if torch.cuda.is_available():
        assert local_gpus(cuda) == torch.cuda.device_count()
    else:  # Ray counts: the cuda stage then fails at start, naming itself (tests/serving/test_gpu_serve_check.py)
        assert local_gpus(cuda) is None
