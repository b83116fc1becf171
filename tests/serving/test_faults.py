"""Lost replicas, killed for real: the client sees no error and the target's exact greedy tokens. In the remote
layout (speculation.drafting remote: the draft stage drafts); the local layout's: test_colocated.py.

Faults are injected deterministically (deployments.faults, config faults.enabled): a stage replica's Nth call
exits its process, or holds until the test kills the replica through Ray. Serve starts a replacement each time.
"""

import concurrent.futures
import json

import grpc
import jsonschema
import pytest
import ray

from services.tree import tree_rows
from splitspec.api.client import SpecDecodeClient
from tests.serving.conftest import BOUND_S, MAX_NEW_TOKENS, arm, handle, held, make_config, serving, until

pytestmark = pytest.mark.slow

APP = "splitspec"
PINNED = dict(speculate=True, num_draft_tokens=2, overlap=False)  # k pinned: a draft and a verify call every step
# prompts whose answers run past the token budget (checked): the faults strike mid-request
LONG = ["Count from 1 to 100.", "Write a short story about a robot.", "List the first 40 even numbers.",
        "Explain how a CPU works, step by step.", "Describe the water cycle in detail."]


@pytest.fixture(scope="module")
def client():
    with serving(make_config(faults={"enabled": True}, speculation={"drafting": "remote"})) as client:
        yield client


def _recoveries() -> dict:
    return handle("SpecDecodeIngress").stats.remote().result(timeout_s=60)["recoveries"]


def _kill(actor_name: str) -> None:
    ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)


def _tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture
def expected(reference):
    def answer(prompt: str, max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
        tokens = reference(prompt, max_new_tokens)
        assert len(tokens) == max_new_tokens, f"{prompt!r} ends before the budget: no fault would strike mid-request"
        return tokens

    return answer


def test_verify_replica_exits_mid_request(client, expected):
    """Unary: the verify replica's process dies at its 3rd verify call; the ingress prefills prompt + tokens so far
    on the prefill replica, reopens the session on the replacement, and verifies the same block again."""
    before = _recoveries().get("verify", 0)
    arm("Verify", "verify", "exit", after=2)
    response = client.generate(messages=[("user", LONG[4])], **PINNED)
    assert list(response.token_ids) == expected(LONG[4])
    assert _recoveries()["verify"] == before + 1


def test_verify_replica_killed_mid_stream(client, expected):
    """Stream, EAGLE drafter: the 4th verify call holds, the test kills the replica through Ray meanwhile."""
    before = _recoveries().get("verify", 0)
    name = arm("Verify", "verify", "hold", after=3)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: list(client.stream(messages=[("user", LONG[0])], drafter="eagle", **PINNED)))
        until("a verify call held", lambda: held("Verify"))
        _kill(name)
        chunks = answer.result(timeout=BOUND_S)
    assert _tokens(chunks) == expected(LONG[0])
    assert chunks[-1].speculation_stats.drafted > 0 and not chunks[-1].speculation_stats.fell_back
    assert _recoveries()["verify"] == before + 1


def test_logprobs_survive_a_lost_verify_replica(client, expected):
    """Stream with logprobs; the verify replica's process dies at its 3rd verify call: one entry per token, none
    lost and none repeated (the recovered stream's first step, the last token again, is not sent), each the
    no-fault run's value (after the loss the KV is a prefill's of the prompt and the tokens: float rounding apart)."""
    kwargs = dict(messages=[("user", LONG[3])], logprobs=True, top_logprobs=2, **PINNED)
    want = list(client.stream(**kwargs))  # no fault
    before = _recoveries().get("verify", 0)
    arm("Verify", "verify", "exit", after=2)
    chunks = list(client.stream(**kwargs))
    assert _recoveries()["verify"] == before + 1
    assert _tokens(chunks) == _tokens(want) == expected(LONG[3])
    got, ref = [e for c in chunks for e in c.logprobs], [e for c in want for e in c.logprobs]
    assert [e.token_id for e in got] == _tokens(chunks) and all(len(e.top_logprobs) == 2 for e in got)
    assert all(abs(a.logprob - b.logprob) <= 1e-4 for a, b in zip(got, ref)), [(a.logprob, b.logprob) for a, b in zip(got, ref)]


def test_a_constrained_answer_survives_a_lost_verify_replica(client):
    """Structured output (a JSON schema) through a lost verify replica: the grammar of the reopened session starts
    after the tokens already emitted (services.constraint: Constraint.prefix), so the answer is the no-fault one,
    token for token, and valid under the schema."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "ages": {"type": "array", "items": {
        "type": "integer"}, "minItems": 6, "maxItems": 6}}, "required": ["name", "ages"], "additionalProperties": False}
    kwargs = dict(messages=[("user", "Give a name and six ages as JSON.")], max_new_tokens=64,
                  json_schema=json.dumps(schema), **PINNED)
    want = list(client.stream(**kwargs))  # no fault
    before = _recoveries().get("verify", 0)
    arm("Verify", "verify", "exit", after=2)
    chunks = list(client.stream(**kwargs))
    assert _recoveries()["verify"] == before + 1
    assert _tokens(chunks) == _tokens(want)
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), schema)


def test_verify_replica_lost_mid_request_without_speculation(client, expected):
    """Speculation off: the loop's 5th step holds, the test kills the replica; the ingress reopens the session on the
    replacement and streams the rest."""
    before = _recoveries().get("verify", 0)
    name = arm("Verify", "verify", "hold", after=4)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: list(client.stream(messages=[("user", LONG[1])], speculate=False)))
        until("a step held", lambda: held("Verify"))
        _kill(name)
        chunks = answer.result(timeout=BOUND_S)
    assert _tokens(chunks) == expected(LONG[1])
    assert chunks[-1].speculation_stats.drafted == 0
    assert _recoveries()["verify"] == before + 1
    stats = until("the session closed on the replacement", lambda: handle("Verify").stats.remote().result(timeout_s=60),
                  done=lambda st: st["sessions"] == 0)
    assert stats["loops"] == 0, stats


def test_verify_replica_exits_in_the_open(client, expected):
    """The session opens (Verify.open, by reference: the handoff), then its loop's steps stream (Verify.speculate, by
    value). The replica's process dies in the open; the ingress opens the session on the replacement from the same
    KV reference and streams the tokens from there."""
    before = _recoveries().get("verify", 0)
    arm("Verify", "open", "exit")
    chunks = list(client.stream(messages=[("user", LONG[3])], speculate=False))
    assert _tokens(chunks) == expected(LONG[3])
    assert _recoveries()["verify"] == before + 1
    stats = until("the session closed on the replacement", lambda: handle("Verify").stats.remote().result(timeout_s=60),
                  done=lambda st: st["sessions"] == 0)
    assert stats["opened"] == 1 and stats["loops"] == 0, stats


def test_client_leaves_while_a_session_is_being_opened(client):
    """Speculation off: the client cancels while the verify replica opens the session (the open holds). The session
    is not left on the replica, nor its loop, and no pass waits for it."""
    arm("Verify", "open", "hold")
    call = client.stream(messages=[("user", LONG[0])], speculate=False)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: list(call))
        until("the open held", lambda: held("Verify"))
        call.cancel()
        with pytest.raises(grpc.RpcError) as failed:
            answer.result(timeout=BOUND_S)
    assert failed.value.code() == grpc.StatusCode.CANCELLED
    handle("Verify").release_fault.remote().result(timeout_s=60)
    until("no session or loop left on the replica", lambda: handle("Verify").stats.remote().result(timeout_s=60),
          done=lambda st: st["sessions"] == 0 and st["loops"] == 0)
    response = client.generate(messages=[("user", LONG[0])], max_new_tokens=8, speculate=False)  # it serves on
    assert len(response.token_ids) == 8


@pytest.mark.parametrize("deployment,point", [("Verify", "opened"), ("Draft", "started")])
def test_client_leaves_while_a_session_opens(client, deployment, point):
    """Speculation on: the client cancels after the replica has opened its session but before it answers (the
    answer holds): the request never learns the session's replica, and the replica closes the session itself.
    No session is left on either stage (CI once found one left after a soak's cancelled requests)."""
    arm(deployment, point, "hold")
    request_id = f"leaves-while-{point}"
    call = client.stream(messages=[("user", LONG[2])], request_id=request_id, **PINNED)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: list(call))
        until("the answer held", lambda: held(deployment))
        call.cancel()
        with pytest.raises(grpc.RpcError) as failed:
            answer.result(timeout=BOUND_S)
    assert failed.value.code() == grpc.StatusCode.CANCELLED
    handle(deployment).release_fault.remote().result(timeout_s=60)
    # (its own sessions: a draft session whose verify replica an earlier test killed stays until it is reaped)
    until("no session of the request left on either stage", lambda: [
        handle(d).sessions_of.remote(request_id).result(timeout_s=60) for d in ("Draft", "Verify")],
        done=lambda ids: ids == [[], []])
    response = client.generate(messages=[("user", LONG[2])], max_new_tokens=8, **PINNED)  # it serves on
    assert len(response.token_ids) == 8


def test_prefill_replica_exits(client, expected):
    """The prefill replica dies on the request's prefill; the call is retried on its replacement."""
    before = _recoveries().get("prefill", 0)
    arm("Prefill", "prefill", "exit")
    response = client.generate(messages=[("user", LONG[1])], **PINNED)
    assert list(response.token_ids) == expected(LONG[1])
    assert _recoveries()["prefill"] == before + 1


def test_draft_replica_lost_then_speculation_resumes(client, expected):
    """The draft replica dies at the 3rd proposal: the request goes on with the target alone (same tokens); its 6th
    verify call holds until a draft replica answers its verify replica again; then it drafts again on a fresh
    session there."""
    before = _recoveries()
    answered = handle("Verify").stats.remote().result(timeout_s=60)["draft_replica_answered"]
    arm("Draft", "propose", "exit", after=2)
    arm("Verify", "verify", "hold", after=5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: list(client.stream(messages=[("user", LONG[2])], max_new_tokens=48,
                                                        drafter="eagle", **PINNED)))
        until("a verify call held", lambda: held("Verify"))
        until("the verify replica saw a draft replica again",
              lambda: handle("Verify").stats.remote().result(timeout_s=60)["draft_replica_answered"] > answered)
        handle("Verify").release_fault.remote().result(timeout_s=60)
        chunks = answer.result(timeout=BOUND_S)
    assert _tokens(chunks) == expected(LONG[2], 48)
    drafted = [c.drafted_tokens for c in chunks[1:]]  # (the first chunk is prefill's token)
    per_step = tree_rows(PINNED["num_draft_tokens"], make_config().speculation.tree_width) - 1  # a greedy step drafts a tree
    assert drafted[:2] == [per_step] * 2 and drafted[2:5] == [0, 0, 0], drafted  # drafts, then the target alone
    assert any(drafted[5:]), drafted  # and drafts again
    assert chunks[-1].speculation_stats.fell_back
    assert _recoveries()["draft"] == before.get("draft", 0) + 1


def test_ingress_replica_lost_client_retries(client, expected):
    """The ingress replica is killed while a unary call is in flight (its verify call holds): the call fails, and the
    client sends it again, to the replacement ingress (UNAVAILABLE until it is up). The ingress replica serves the port
    here (direct ingress), so the call's connection breaks: UNAVAILABLE from the first (through Serve's proxy, Ray 2.60
    says INTERNAL, "actor died unexpectedly": splitspec.api.client.retryable, tests/deployments/test_faults.py)."""
    ingress = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"SERVE_REPLICA::{APP}#SpecDecodeIngress#"))
    retries = []
    with SpecDecodeClient(client.address, timeout_s=BOUND_S, retries=10,  # (a slow machine restarts slowly)
                          on_retry=lambda exc, *_: retries.append(exc.code())) as c:
        arm("Verify", "verify", "hold", after=1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(c.generate, messages=[("user", LONG[3])], **PINNED)
            until("a verify call held", lambda: held("Verify"))
            _kill(ingress)
            response = answer.result(timeout=BOUND_S)
    handle("Verify").release_fault.remote().result(timeout_s=60)  # (the lost request's call)
    assert list(response.token_ids) == expected(LONG[3])
    assert retries and set(retries) == {grpc.StatusCode.UNAVAILABLE}, retries
