"""Several applications on one Serve, through its proxy (which routes by the ``application`` metadata): a stage pinned
to a label no node has fails fast and its app answers UNAVAILABLE; an app without a drafter answers exactly; an app
with a chat template of its own renders tools through it. (Direct
ingress, `splitspec serve`'s way on its own cluster, serves one application: config.direct_ingress.)"""

import json
import time
from pathlib import Path

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.api.client import make_request
from splitspec.cluster import PlacementError, deploy, placements_for
from tests.serving.conftest import make_config, serving
from tests.serving.test_errors import OK_PROMPT, OPENAI_PROMPT
from tests.serving.test_openai import WEATHER

CHATML_TOOLS = Path(__file__).resolve().parents[1] / "fixtures" / "chatml_tools.jinja"

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


@pytest.fixture(scope="module")
def nodraft(proxied):
    """An app whose draft stage cannot be placed, with a chat template of its own (models.chat_template: the default
    pair's with a Hermes tool section), deployed beside the first."""
    data = placements_for(1, make_config(placement_timeout_s=3)).model_dump()
    data["stages"]["draft"]["placement"] = {"label_selector": {"splitspec.io/accelerator": "nowhere"}}
    data["speculation"]["drafting"] = "remote"  # (drafting locally, the verify replica drafts: no draft stage needed)
    data["models"]["chat_template"] = str(CHATML_TOOLS)  # (read into the config: the text travels with it)
    with pytest.raises(PlacementError) as err:
        deploy(type(make_config()).model_validate(data), name="nodraft", route_prefix="/nodraft")
    assert list(err.value.problems) == ["draft"]
    yield (("application", "nodraft"),)
    from ray import serve

    serve.delete("nodraft", _blocking=False)


def test_missing_draft_stage_degrades_to_target_alone(proxied, nodraft, reference):
    """Without a placeable drafter, requests still get the target's exact answer, speculation off and counted as a
    fallback (the app's template renders a chat without tools as the default pair's own does)."""
    deadline = time.monotonic() + 120
    while True:  # the app's ingress, prefill and verify come up; its draft stage never does
        try:
            response = proxied.stub.Generate(make_request(messages=OK_PROMPT, max_new_tokens=16, num_draft_tokens=3),
                                             metadata=nodraft, timeout=60)
            break
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, (exc.code(), exc.details())
            time.sleep(1)
    assert list(response.token_ids) == reference(OK_PROMPT[0][1])[:16]
    assert response.speculation_stats.fell_back and response.speculation_stats.drafted == 0


def test_tools_go_through_the_model_s_own_template(proxied, nodraft):
    """A template that renders tools (models.chat_template here) is the prompt format: the prompt is the template's
    rendering of the tools and the history's calls and results, the call comes back parsed."""
    from transformers import AutoTokenizer

    from deployments import tools
    from services.models import default_pair

    tokenizer = AutoTokenizer.from_pretrained(default_pair.prepare()[0])
    tokenizer.chat_template = CHATML_TOOLS.read_text()
    root = proxied.http_base_url.removesuffix("/v1") + "/nodraft/v1"
    first = [{"role": "user", "content": "What is the weather in Paris?"}]
    with openai.OpenAI(base_url=root, api_key="not-checked-here", max_retries=0, timeout=300) as oai:
        answer = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=first, tools=[WEATHER],
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                             temperature=0, max_tokens=48)
        calls = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
        history = first + [answer.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21}'}]
        second = oai.chat.completions.create(model=answer.model, messages=history, tools=[WEATHER], temperature=0,
                                             max_tokens=8)
        with pytest.raises(openai.BadRequestError, match="the server's limit is 256"):  # checked before rendering
            oai.chat.completions.create(model=answer.model, messages=first * 300, tools=[WEATHER], max_tokens=4)
    for messages, response in ((first, answer), (history, second)):
        plan = tools.plan([WEATHER], "auto", None)
        prompt = tools.render_prompt(tokenizer, messages, plan)
        assert response.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])  # the template's prompt
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
