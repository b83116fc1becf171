"""Several applications on one Serve, through its proxy (which routes by the ``application`` metadata): a stage pinned
to a label no node has fails fast and its app answers UNAVAILABLE; an app without a drafter answers exactly. (Direct
ingress, `splitspec serve`'s way on its own cluster, serves one application: config.direct_ingress.)"""

import time

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.api.client import make_request
from splitspec.cluster import PlacementError, deploy, placements_for
from tests.serving.conftest import make_config, serving
from tests.serving.test_errors import OK_PROMPT, OPENAI_PROMPT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def proxied():
    with serving(make_config(), direct_ingress=False) as client:
        yield client


def test_missing_label_fails_fast_and_requests_get_unavailable(proxied):
    """A stage pinned to a label no node has is reported by name within the bound; its app answers UNAVAILABLE."""
    config = placements_for(1, make_config(placement_timeout_s=3))
    data = config.model_dump()
    data["stages"]["verify"]["placement"] = {"label_selector": {"splitspec.io/accelerator": "nowhere"}}
    broken = type(config).model_validate(data)
    with pytest.raises(PlacementError) as err:  # not deploy's own TimeoutError: the placement check reported it first
        deploy(broken, name="broken", route_prefix="/broken", timeout_s=30)
    assert list(err.value.problems) == ["verify"]
    assert "splitspec.io/accelerator=nowhere" in str(err.value)
    deadline = time.monotonic() + 60
    while True:  # the broken app's ingress comes up; its stages never do
        try:
            proxied.stub.Generate(make_request("hi", max_new_tokens=4),
                                 metadata=(("application", "broken"),), timeout=30)
            raise AssertionError("a request to an unplaceable stage succeeded")
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "verify" in exc.details():
                assert "splitspec.io/accelerator=nowhere" in exc.details()
                break
            assert time.monotonic() < deadline, (exc.code(), exc.details())
            time.sleep(1)
    check = health_pb2_grpc.HealthStub(proxied.channel).Check(health_pb2.HealthCheckRequest(),
                                                             metadata=(("application", "broken"),), timeout=30)
    assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING  # its verify stage has no replica
    root = proxied.http_base_url.removesuffix("/v1") + "/broken"  # the app's route prefix
    response = httpx.post(f"{root}/v1/chat/completions", json={"messages": OPENAI_PROMPT, "max_tokens": 4}, timeout=60)
    assert response.status_code == 503 and "splitspec.io/accelerator=nowhere" in response.json()["error"]["message"]
    assert httpx.get(f"{root}/health", timeout=60).status_code == 503
    from ray import serve

    serve.delete("broken", _blocking=False)
    good = proxied.stub.Generate(make_request(messages=OK_PROMPT, max_new_tokens=4), metadata=(("application", "splitspec"),))
    assert good.usage.completion_tokens > 0


def test_missing_draft_stage_degrades_to_target_alone(proxied, reference):
    """Without a placeable drafter, requests still get the target's exact answer, speculation off and counted as a fallback."""
    data = placements_for(1, make_config(placement_timeout_s=3)).model_dump()
    data["stages"]["draft"]["placement"] = {"label_selector": {"splitspec.io/accelerator": "nowhere"}}
    data["speculation"]["drafting"] = "remote"  # (drafting locally, the verify replica drafts: no draft stage needed)
    with pytest.raises(PlacementError) as err:
        deploy(type(make_config()).model_validate(data), name="nodraft", route_prefix="/nodraft")
    assert list(err.value.problems) == ["draft"]
    metadata = (("application", "nodraft"),)
    deadline = time.monotonic() + 120
    while True:  # the app's ingress, prefill and verify come up; its draft stage never does
        try:
            response = proxied.stub.Generate(make_request(messages=OK_PROMPT, max_new_tokens=16, num_draft_tokens=3),
                                             metadata=metadata, timeout=60)
            break
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, (exc.code(), exc.details())
            time.sleep(1)
    assert list(response.token_ids) == reference(OK_PROMPT[0][1])[:16]
    assert response.speculation_stats.fell_back and response.speculation_stats.drafted == 0
    from ray import serve

    serve.delete("nodraft", _blocking=False)
