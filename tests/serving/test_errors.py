"""Every bad input gets its gRPC status and an actionable message; the service keeps serving (a missing label failing
fast: tests/serving/test_apps.py)."""

import collections
import concurrent.futures
import json

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.api.client import make_request
from tests.serving.conftest import BOUND_S, arm, handle, held, make_config, open_sessions, serving, until

pytestmark = pytest.mark.slow

OK_PROMPT = [("user", "What is the capital of France?")]  # (role, content)
OPENAI_PROMPT = [{"role": role, "content": content} for role, content in OK_PROMPT]
# For a request whose third verify call holds: its answer runs past 64 tokens, so however many tokens a verify call
# accepts (the server's drafters and policy adapt to load) the request reaches that call. (The short answer above can
# come whole in two.)
HELD_PROMPT = [("user", "Count from 1 to 100.")]
OPENAI_HELD_PROMPT = [{"role": role, "content": content} for role, content in HELD_PROMPT]
BAD = [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="hi", messages=[("user", "hi")]), "not both"),
    (dict(messages=[("wizard", "hi")]), "role"),
    (dict(prompt="hello " * 9000), "shorten the prompt"),
    (dict(prompt="hello " * 5000), "context is 4096: shorten the prompt"),  # the target's 8192, the verifier's capacity
    (dict(prompt="hi", max_new_tokens=100_000), "limit"),
    (dict(prompt="hi", max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(prompt="hi", temperature=-0.5), "temperature must be >= 0"),
    (dict(prompt="hi", top_p=0.0), "top_p must be in (0, 1]"),
    (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1]"),
    (dict(prompt="hi", num_draft_tokens=17), "num_draft_tokens (k) must be"),
    (dict(prompt="hi", drafter="oracle"), "unknown drafter"),
    (dict(prompt="hi", stop=[""]), "stop sequences"),
    # hostile input: each is refused with the limit named, before any model work
    (dict(prompt="hi", temperature=float("nan")), "temperature must be a finite number"),
    (dict(prompt="hi", temperature=float("inf")), "temperature must be a finite number"),
    (dict(prompt="hi", top_p=float("nan")), "top_p must be in (0, 1]"),
    (dict(prompt="hi", top_p=float("inf")), "top_p must be in (0, 1]"),
    (dict(prompt="x" * 2**20), "the server's limit is 65536: shorten the prompt"),
    (dict(messages=[("user", "y" * 2**20)]), "the server's limit is 65536: shorten the prompt"),
    (dict(messages=[("user", "hi")] * 2000), "2000 chat messages, the server's limit is 256"),
    (dict(prompt="hi", stop=["a"] * 1000), "at most 8 stop sequences"),
    (dict(prompt="hi", stop=["z" * 10_000]), "at most 256 characters"),
]


REQUEST_TIMEOUT_S = 10  # the server's deadline here (limits.request_timeout_s); every request but the held ones is short


@pytest.fixture(scope="module")
def client():
    config = make_config(limits={"max_ongoing_requests": 1, "max_queued_requests": 1, "request_timeout_s": REQUEST_TIMEOUT_S},
                         faults={"enabled": True}, stages={"verify": {"kv_capacity": 4096}})
    with serving(config) as client:  # (direct ingress, as `splitspec serve` runs it: tests/serving/test_apps.py has the proxy)
        yield client



@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_invalid_argument(client, kwargs, message, stream):
    with pytest.raises(grpc.RpcError) as err:
        if stream:
            list(client.stream(**kwargs))
        else:
            client.generate(**kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert "Traceback" not in err.value.details() and "ray" not in err.value.details().lower()


def test_garbage_bytes_and_oversized_messages_leave_the_service_serving(client):
    """Bytes that are no GenerateRequest, and a message beyond gRPC's 4 MB limit, get an error status; then a good
    request is served."""
    garbage = client.channel.unary_unary("/splitspec.v1.SpecDecode/Generate")  # raw bytes in, raw bytes out
    with pytest.raises(grpc.RpcError) as err:
        garbage(b"\xff\xfe\x00 this is not a protobuf \x01\x02", timeout=60)
    # refused by the proxy's protobuf decoder, before splitspec's code runs: gRPC's own status
    assert err.value.code() == grpc.StatusCode.UNKNOWN and "GenerateRequest" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt="z" * (5 * 2**20))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.generate(messages=OK_PROMPT, max_new_tokens=4).usage.completion_tokens > 0


def test_standard_health_check(client):
    """grpc.health.v1.Health/Check through the Serve proxy, without a token: SERVING; another service: NOT_FOUND."""
    health = health_pb2_grpc.HealthStub(client.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    request = health_pb2.HealthCheckRequest(service="splitspec.v1.SpecDecode")
    assert health.Check(request, timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="other.Service"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_good_request_after_bad_ones(client):
    response = client.generate(messages=OK_PROMPT, max_new_tokens=8)
    assert response.usage.completion_tokens > 0


def _grpc_call(client, i):
    """A streamed request: its chunks, or its status code."""
    try:
        return list(client.stream(messages=OK_PROMPT, max_new_tokens=8, speculate=False, request_id=str(i)))
    except grpc.RpcError as exc:
        return exc.code()


def _http_call(client, i):
    """The same over the OpenAI API: its events (the last one is [DONE]), or (HTTP status, Retry-After)."""
    body = {"messages": OPENAI_PROMPT, "max_tokens": 8, "stream": True, "speculation": {"mode": "off"}}
    with httpx.stream("POST", f"{client.http_base_url}/chat/completions", json=body, timeout=BOUND_S,
                      headers={"x-request-id": str(i)}) as response:
        if response.status_code != 200:
            return response.status_code, response.headers.get("retry-after")
        return [line for line in response.iter_lines() if line]


QUEUE_FULL = {"grpc": (_grpc_call, grpc.StatusCode.RESOURCE_EXHAUSTED, lambda chunks: chunks[-1].finish_reason),
              "http": (_http_call, (429, "1"), lambda events: events[-1] == "data: [DONE]")}


@pytest.mark.parametrize("api", QUEUE_FULL)
def test_queue_full_is_resource_exhausted(client, api):
    """One running request (its verify call held) and one queued fill the ingress; the others are refused at once
    (gRPC RESOURCE_EXHAUSTED; HTTP 429 with Retry-After); once the verify call goes on, the two are served."""
    send, refusal, complete = QUEUE_FULL[api]

    def call(i):
        return send(client, i)

    arm("Verify", "verify", "hold")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        running = pool.submit(call, 0)
        until("the running request's verify call held", lambda: held("Verify"))
        others = [pool.submit(call, i) for i in range(1, 6)]
        refused = until("four requests refused", lambda: [f for f in others if f.done()] if sum(
            f.done() for f in others) == 4 else None)
        assert [f.result() for f in refused] == [refusal] * 4
        handle("Verify").release_fault.remote().result(timeout_s=60)
        served = [running.result(timeout=BOUND_S)] + [f.result(timeout=BOUND_S) for f in others if f not in refused]
    assert len(served) == 2 and all(complete(answer) for answer in served), served
    assert client.generate(messages=OK_PROMPT, max_new_tokens=4).usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_client_deadline_frees_the_sessions(client, stream):
    """The client's deadline passes while the request's verify call holds: DEADLINE_EXCEEDED, and the request's draft
    and verify sessions are closed."""
    arm("Verify", "verify", "hold", after=2)
    request = make_request(messages=HELD_PROMPT, max_new_tokens=64, stream=stream)
    with pytest.raises(grpc.RpcError) as err:
        if stream:
            list(client.stub.GenerateStream(request, timeout=3))
        else:
            client.stub.Generate(request, timeout=3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    until("sessions closed, KV freed", open_sessions, done=lambda held: not any(held.values()))
    handle("Verify").release_fault.remote().result(timeout_s=60)  # (nothing holds: the call was cancelled)
    assert client.generate(messages=OK_PROMPT, max_new_tokens=4).usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_server_deadline_frees_the_sessions(client, stream):
    """The server's deadline (limits.request_timeout_s) passes while a verify call holds: DEADLINE_EXCEEDED naming the
    limit, on both RPCs (a stream too, between chunks), and the sessions are closed."""
    arm("Verify", "verify", "hold", after=2)
    with pytest.raises(grpc.RpcError) as err:
        if stream:
            list(client.stream(messages=HELD_PROMPT, max_new_tokens=64))
        else:
            client.generate(messages=HELD_PROMPT, max_new_tokens=64)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"limits.request_timeout_s ({REQUEST_TIMEOUT_S}s)" in err.value.details()
    until("sessions closed, KV freed", open_sessions, done=lambda held: not any(held.values()))
    handle("Verify").release_fault.remote().result(timeout_s=60)
    assert client.generate(messages=OK_PROMPT, max_new_tokens=4).usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_server_deadline_over_http(client, stream):
    """Over the OpenAI API the server's deadline is a 504 in OpenAI's error JSON, or, once a stream has begun, an error
    event and [DONE]; the sessions are closed."""
    arm("Verify", "verify", "hold", after=2)
    body = {"messages": OPENAI_HELD_PROMPT, "max_tokens": 64, "temperature": 0, "stream": stream}
    response = httpx.post(f"{client.http_base_url}/chat/completions", json=body, timeout=BOUND_S)
    expected = f"limits.request_timeout_s ({REQUEST_TIMEOUT_S}s)"
    if stream:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert response.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "timeout_error" and error["code"] == 504 and expected in error["message"]
    else:
        assert response.status_code == 504 and expected in response.json()["error"]["message"]
    until("sessions closed, KV freed", open_sessions, done=lambda held: not any(held.values()))
    handle("Verify").release_fault.remote().result(timeout_s=60)


def _finished() -> collections.Counter:
    """Requests the ingress has finished, by "<method> <outcome>"."""
    return collections.Counter(handle("SpecDecodeIngress").stats.remote().result(timeout_s=60)["requests"])


def test_http_client_gone_mid_stream_frees_the_sessions(client):
    """An OpenAI-API client that closes its stream while a verify call holds: the request is cancelled (not ended by
    the server's deadline), its draft and verify sessions are closed, and the service goes on."""
    before = _finished()
    arm("Verify", "verify", "hold", after=2)
    body = {"messages": OPENAI_HELD_PROMPT, "max_tokens": 64, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{client.http_base_url}/chat/completions", json=body, timeout=BOUND_S) as response:
        assert response.status_code == 200
        until("the verify call held", lambda: held("Verify"))
        assert any(line.startswith("data: {") for line in response.iter_lines())  # (the first events came)
    # the connection is closed: Serve cancels the request
    until("the request cancelled", lambda: _finished()["ChatCompletions CANCELLED"] - before["ChatCompletions CANCELLED"])
    until("sessions closed, KV freed", open_sessions, done=lambda held: not any(held.values()))
    assert _finished()["ChatCompletions DEADLINE_EXCEEDED"] == before["ChatCompletions DEADLINE_EXCEEDED"]
    handle("Verify").release_fault.remote().result(timeout_s=60)
    answer = httpx.post(f"{client.http_base_url}/chat/completions", timeout=BOUND_S,
                        json={"messages": OPENAI_PROMPT, "max_tokens": 4, "temperature": 0})
    assert answer.json()["usage"]["completion_tokens"] == 4
