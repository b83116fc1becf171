"""The remote layout (speculation.drafting remote: the draft stage drafts, asked by the verify replica directly, and
pre-drafts by default) through gRPC: greedy output equals the target alone, for every drafter kind, pinned and
adaptive k, with and without pre-drafting, and speculation off. (The local layout: test_colocated.py.)"""

import pytest

from splitspec.api.v1 import splitspec_pb2 as pb
from tests.serving.conftest import (
    MAX_NEW_TOKENS, PROMPTS, assert_second_token_follows_the_target, handle, in_pairs, local_prefills, make_config,
    serving,
)

pytestmark = pytest.mark.slow

POLICIES = [dict(speculate=False)] + [  # (overlap unset: the remote layout's default, pre-drafting)
    dict(speculate=True, drafter=drafter, num_draft_tokens=k) for drafter, k in (
        ("model", 1), ("model", 3), ("hybrid", 0), ("eagle", 2), ("eagle", 5), ("prompt_lookup", 3))
] + [  # without pre-drafting: chains, and trees for these greedy requests (k = 0: the server's adaptive k)
    dict(speculate=True, drafter=drafter, num_draft_tokens=k, overlap=False) for drafter, k in (
        ("hybrid", 0), ("eagle", 3), ("model", 2), ("prompt_lookup", 1))
]


def policy_id(p: dict) -> str:
    return "off" if not p["speculate"] else f"{p['drafter']}-k{p['num_draft_tokens']}{'' if p.get('overlap', True) else '-no-overlap'}"


@pytest.fixture(scope="module")
def client():
    with serving(make_config(speculation={"drafting": "remote"})) as client:
        yield client


@pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
def test_greedy_equals_target_alone(client, reference, policy):
    hits = 0
    for prompt, response in in_pairs(client, PROMPTS, **policy):
        assert list(response.token_ids) == reference(prompt), prompt
        stats = response.speculation_stats
        assert stats.enabled == policy["speculate"]
        assert stats.adaptive == (policy["speculate"] and policy["num_draft_tokens"] == 0)
        assert stats.accepted <= stats.drafted
        assert stats.overlap == (policy["speculate"] and policy.get("overlap", True))
        assert stats.pre_draft_hits <= stats.pre_drafts <= stats.steps
        assert (stats.pre_drafts > 0) == stats.overlap
        hits += stats.pre_draft_hits
        assert response.usage.completion_tokens == len(response.token_ids)
    pre_drafting_models = policy["speculate"] and policy.get("overlap", True) and policy["drafter"] != "prompt_lookup"
    assert hits > 0 or not pre_drafting_models, "no pre-drafted block was used"


@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_stream_concatenates_to_unary_and_echoes_id(client, drafter):
    for i, prompt in enumerate(PROMPTS[:4]):
        kwargs = dict(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=3, drafter=drafter)
        unary = client.generate(request_id=f"u-{i}", **kwargs)
        chunks = list(client.stream(request_id=f"s-{i}", **kwargs))
        assert unary.request_id == f"u-{i}" and {c.request_id for c in chunks} == {f"s-{i}"}
        assert "".join(c.text for c in chunks) == unary.text
        assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
        assert [c.finish_reason for c in chunks[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == unary.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert sum(c.accepted_tokens for c in chunks) == unary.speculation_stats.accepted


def test_stop_sequence_and_raw_prompt(client, target_info):
    full = client.generate(messages=[("user", "Count from 1 to 10.")], max_new_tokens=40)
    assert "4" in full.text
    cut = client.generate(messages=[("user", "Count from 1 to 10.")], max_new_tokens=40, stop=["4"])
    assert cut.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert cut.text == full.text[: full.text.index("4")]
    streamed = list(client.stream(messages=[("user", "Count from 1 to 10.")], max_new_tokens=40, stop=["4"]))
    assert "".join(c.text for c in streamed) == cut.text
    raw = client.generate("The capital of France is", max_new_tokens=8)
    assert raw.usage.prompt_tokens == len(target_info.tokenizer("The capital of France is")["input_ids"])


def test_speculation_off_is_the_loop_without_drafts(client, reference):
    """Without speculation a request's loop runs in its verify replica as with it, without a draft session; a stop
    sequence that cuts the answer ends its stream, and the session and its loop close."""
    from tests.serving.conftest import until

    def verify_stats():
        return handle("Verify").stats.remote().result(timeout_s=60)

    opened = handle("Draft").stats.remote().result(timeout_s=60)["opened"]
    response = client.generate(messages=[("user", PROMPTS[2])], max_new_tokens=MAX_NEW_TOKENS, speculate=False)
    assert list(response.token_ids) == reference(PROMPTS[2])
    assert response.speculation_stats.steps == len(response.token_ids) - 1  # a step per token after prefill's
    cut = list(client.stream(messages=[("user", "Count from 1 to 10.")], max_new_tokens=40, stop=["4"], speculate=False))
    assert cut[-1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    stats = until("the cut request's session closed", verify_stats, done=lambda st: st["sessions"] == 0)
    assert stats["loops"] == 0 and stats["drafting"] == "remote", stats
    assert handle("Draft").stats.remote().result(timeout_s=60)["opened"] == opened  # no draft session


@pytest.mark.parametrize("drafter,overlap", [("model", False), ("eagle", False), ("eagle", True)])
def test_seeded_sampling_is_reproducible_through_the_graph(client, drafter, overlap):
    """temperature > 0 with a seed: the same request gives the same answer (random streams travel with the session)."""
    kwargs = dict(messages=[("user", PROMPTS[1])], max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.95, seed=7,
                  num_draft_tokens=3, drafter=drafter, overlap=overlap)
    first, second = client.generate(**kwargs), client.generate(**kwargs)
    assert list(first.token_ids) == list(second.token_ids)
    assert first.speculation_stats.drafted > 0
    other = client.generate(**{**kwargs, "seed": 8})
    assert list(other.token_ids) != list(first.token_ids)


def test_server_reflection_lists_the_service(client):
    """grpcurl and other tools can discover splitspec.v1.SpecDecode through server reflection."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    answer = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
    assert "splitspec.v1.SpecDecode" in [s.name for s in answer.list_services_response.service]


def test_server_default_is_adaptive_with_the_hybrid_drafter(client, reference):
    response = client.generate(messages=[("user", PROMPTS[0])], max_new_tokens=MAX_NEW_TOKENS)
    assert list(response.token_ids) == reference(PROMPTS[0])
    stats = response.speculation_stats
    assert stats.enabled and stats.adaptive and stats.drafter == "hybrid" and stats.num_draft_tokens == 4


def test_under_load_the_server_default_goes_without_a_drafter(client, reference):
    """With more requests in flight than speculation.off_above_concurrency (2), an adaptive request opens no draft
    session (services.policy.RequestGate): the stats say so, and the answer is the target's."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [client.stream(messages=[("user", p)], max_new_tokens=64, speculate=False) for p in PROMPTS[1:3]]
        firsts = [next(s) for s in streams]  # both are generating now
        rests = [pool.submit(list, s) for s in streams]
        response = client.generate(messages=[("user", PROMPTS[0])], max_new_tokens=MAX_NEW_TOKENS)
        for first, rest in zip(firsts, rests):
            assert first.token_ids and rest.result()[-1].finish_reason  # the loaded streams finish normally
    stats = response.speculation_stats
    assert stats.enabled and stats.adaptive and stats.declined and stats.drafted == 0 and stats.steps > 0, stats
    assert list(response.token_ids) == reference(PROMPTS[0])


SAMPLED_DRAWS = 400


def test_sampled_tokens_follow_the_target_through_the_graph(client, default_pair, target_info):
    """Seeded draws through gRPC with EAGLE drafts (k = 2): given the first token, the second follows the target's p.

    The second token is the first verify step's: an accepted draft or a recovered token, so the draft ids and their
    q crossed the graph (draft replica -> verify replica) and were used by the exact sampler there.
    """
    assert_second_token_follows_the_target(client, default_pair, target_info, SAMPLED_DRAWS)


def test_concurrent_streams_are_batched_and_each_equals_its_answer_alone(client, reference):
    """12 concurrent requests with different policies (off, fixed k, adaptive), greedy and seeded sampled: the
    verifier batches their steps and the drafter their proposals into shared passes, and every answer is the one
    the request gets alone."""
    import concurrent.futures

    from ray import serve

    sampled = dict(temperature=0.8, top_p=0.95, seed=7, speculate=True, drafter="eagle", num_draft_tokens=2)
    alone = list(client.generate(messages=[("user", PROMPTS[0])], max_new_tokens=MAX_NEW_TOKENS, **sampled).token_ids)
    mix = [dict(speculate=False), dict(speculate=True, drafter="eagle", num_draft_tokens=1),
           dict(speculate=True, drafter="eagle", num_draft_tokens=3), dict(speculate=True, drafter="model", num_draft_tokens=2),
           dict(speculate=True, drafter="eagle", num_draft_tokens=0)]
    jobs = [(prompt, mix[i % len(mix)]) for i, prompt in enumerate(PROMPTS * 3)][:11] + [(PROMPTS[0], sampled)]
    verify, draft = (serve.get_deployment_handle(stage, "splitspec") for stage in ("Verify", "Draft"))
    before = verify.stats.remote().result(), draft.stats.remote().result()

    def run(job):
        prompt, policy = job
        chunks = list(client.stream(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, **policy))
        return [t for c in chunks for t in c.token_ids]

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(run, jobs))
    for (prompt, policy), tokens in zip(jobs[:-1], answers[:-1]):
        assert tokens == reference(prompt), (prompt, policy)
    assert answers[-1] == alone  # the seeded sampled request: same draws batched as alone
    after = verify.stats.remote().result(), draft.stats.remote().result()
    assert after[0]["largest_pass"] >= 2, (before, after)  # steps of different sessions shared a target pass
    assert after[1]["largest_pass"] >= 2, (before, after)  # and proposals a draft pass


def test_prompts_that_share_the_chat_template_reuse_its_kv(client, reference):
    """Chat prompts open with the template's system turn: the prefill replica reuses that prefix's KV (the prefix
    cache is on in the default config, so every greedy answer above was checked with it)."""
    before = handle("Prefill").stats.remote().result(timeout_s=60)
    for prompt in PROMPTS[:2]:
        assert list(client.generate(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS).token_ids) == reference(prompt)
    after = handle("Prefill").stats.remote().result(timeout_s=60)
    assert after["prefix_hit_tokens"] > before["prefix_hit_tokens"]
    assert after["prefix_hit_tokens"] < after["prefix_queried_tokens"] and after["prefix_cached_prompts"] > 0


def test_a_repeated_prompt_is_prefilled_by_the_verify_replica(client, reference):
    """limits.local_prefill_tokens (default 2) through this graph: the same prompt again leaves its last position to
    the verify replica, whose loop's first step computes it (a request without a feature drafter; the drafter
    starts meanwhile) — and the answers stay the target's."""
    prompt = "Name three primary colors."
    before = local_prefills()
    for policy in (dict(speculate=False), dict(speculate=False), dict(speculate=True, drafter="model", num_draft_tokens=2)):
        response = client.generate(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, **policy)
        assert list(response.token_ids) == reference(prompt), policy
    assert local_prefills() == before + 2
