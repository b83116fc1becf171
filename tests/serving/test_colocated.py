"""The local layout (speculation.drafting auto, on one machine where nothing gives the draft stage a device of its
own): each verify replica drafts itself in the request's loop there, with no draft stage deployed. Greedy output equals the target alone for every drafter and for
adaptive and pinned k; seeded sampling is reproducible and follows the target; concurrent sessions share draft and
verify passes; a lost verify replica is recovered from; a cancelled stream leaves no session. Also, in this default
config, a repeated prompt's last position prefilled by the verify replica (limits.local_prefill_tokens)."""

import concurrent.futures
import os

import pytest
import ray

from tests.serving.conftest import (
    BOUND_S, MAX_NEW_TOKENS, PROMPTS, arm, assert_second_token_follows_the_target, handle, held, in_pairs,
    local_prefills, make_config, serving, until,
)

pytestmark = pytest.mark.slow

VERIFY_CPU = max(os.sched_getaffinity(0))
REPEAT_MODULE = "tests.serving.repeat_drafter"
POLICIES = [dict(speculate=True, drafter=drafter, num_draft_tokens=k)  # k = 0: adaptive (hybrid-k0: the server default)
            for drafter, k in (("hybrid", 0), ("hybrid", 3), ("model", 0), ("model", 3), ("eagle", 1), ("eagle", 3),
                               ("prompt_lookup", 0), ("prompt_lookup", 3))]  # (each kind adaptive or with 1, and with 3)


@pytest.fixture(scope="module")
def client():
    # (prefill: saturated from one call on, at nice 19: a raise, which needs no privilege)
    # verify alone on the last CPU, the ingress on the first (placement.cpus; one CPU: both on it)
    stages = {"verify": {"engine_nice": 0, "placement": {"cpus": [VERIFY_CPU]}},
              "prefill": {"saturated_nice": 19, "saturated_calls": 1}}
    # (and a drafter kind of the tests' own: tests/serving/repeat_drafter.py)
    with serving(make_config(faults={"enabled": True}, stages=stages, models={"drafter_modules": [REPEAT_MODULE]},
                             ingress_placement={"cpus": [min(os.sched_getaffinity(0))]})) as client:
        yield client


def _stats(deployment: str) -> dict:
    return handle(deployment).stats.remote().result(timeout_s=60)


def _tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p['drafter']}-k{p['num_draft_tokens']}")
def test_greedy_equals_target_alone(client, reference, policy):
    drafted = 0
    for prompt, response in in_pairs(client, PROMPTS, **policy):
        assert list(response.token_ids) == reference(prompt), prompt
        stats = response.speculation_stats
        assert stats.enabled and stats.adaptive == (policy["num_draft_tokens"] == 0) and not stats.fell_back
        assert stats.accepted <= stats.drafted and stats.steps > 0
        assert stats.accepted + stats.steps + 1 >= len(response.token_ids)  # every token came from a step
        drafted += stats.drafted
    assert drafted > 0 or policy["drafter"] == "prompt_lookup"
    assert _stats("Verify")["drafting"] == "local"  # (no draft stage: the app did not deploy one)
    assert _stats("Verify")["draft_passes"] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_drafter_kind_added_by_a_module_serves(client, reference, temperature):
    """A drafter kind is one module and one registry line (tests/serving/repeat_drafter.py, named in
    models.drafter_modules): requests name it, it drafts, and greedy answers stay the target's."""
    kwargs = dict(messages=[("user", "Count from 1 to 10.")], max_new_tokens=MAX_NEW_TOKENS, drafter="repeat",
                  num_draft_tokens=2, temperature=temperature, seed=5)
    response = client.generate(**kwargs)
    stats = response.speculation_stats
    assert stats.drafter == "repeat" and stats.drafted > 0 and not stats.fell_back, stats
    if temperature == 0:
        assert list(response.token_ids) == reference("Count from 1 to 10.")
    else:
        assert list(client.generate(**kwargs).token_ids) == list(response.token_ids)  # seeded: reproducible


def test_stream_matches_unary(client):
    kwargs = dict(messages=[("user", PROMPTS[3])], max_new_tokens=MAX_NEW_TOKENS, drafter="eagle", num_draft_tokens=2)
    unary = client.generate(**kwargs)
    chunks = list(client.stream(**kwargs))
    assert _tokens(chunks) == list(unary.token_ids)
    assert "".join(c.text for c in chunks) == unary.text
    assert sum(c.accepted_tokens for c in chunks) == unary.speculation_stats.accepted
    assert sum(c.drafted_tokens for c in chunks) == unary.speculation_stats.drafted


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(messages=[("user", PROMPTS[1])], max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.95, seed=7,
                  num_draft_tokens=3, drafter="eagle")
    first, second = client.generate(**kwargs), client.generate(**kwargs)
    assert list(first.token_ids) == list(second.token_ids) and first.speculation_stats.drafted > 0
    assert list(client.generate(**{**kwargs, "seed": 8}).token_ids) != list(first.token_ids)


SAMPLED_DRAWS = 300


def test_sampled_tokens_follow_the_target(client, default_pair, target_info):
    """Seeded draws with EAGLE drafts (k = 2) drafted in the verify replica: the second token (the first verify
    step's, an accepted draft or a recovered token) follows the target's p given the first."""
    assert_second_token_follows_the_target(client, default_pair, target_info, SAMPLED_DRAWS)


def _in_one_pass(jobs: list, run) -> list:
    """``run(job)`` for every job at once, their calls gathered into one pass: the replica's next target pass holds
    (a fault point) until at least half of the jobs' calls queue behind it, then goes on; their results."""
    arm("Verify", "pass", "hold")
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        try:
            until("the jobs' calls queued behind the held pass", lambda: _stats("Verify")["queued"] >= len(jobs) // 2)
        finally:
            handle("Verify").release_fault.remote().result(timeout_s=60)
        return [f.result() for f in futures]


def test_concurrent_streams_share_draft_and_verify_passes(client, reference):
    """Eight concurrent speculating requests (pinned and adaptive k, EAGLE and the model drafter): each answer is the
    one it gets alone, and the replica drafted and verified several sessions in one pass (the pass they share is
    made: ``_in_one_pass``)."""
    mix = [dict(drafter="eagle", num_draft_tokens=1), dict(drafter="eagle", num_draft_tokens=3),
           dict(drafter="model", num_draft_tokens=2), dict(drafter="eagle", num_draft_tokens=0)]
    jobs = [(prompt, mix[i % len(mix)]) for i, prompt in enumerate(PROMPTS)]

    def run(job):
        prompt, policy = job
        return _tokens(client.stream(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, speculate=True, **policy))

    answers = _in_one_pass(jobs, run)
    for (prompt, policy), tokens in zip(jobs, answers):
        assert tokens == reference(prompt), (prompt, policy)
    stats = _stats("Verify")
    assert stats["largest_pass"] >= 2 and stats["draft_largest_pass"] >= 2, stats


def test_tiny_temperatures_share_a_pass_with_greedy_streams(client, reference):
    """Requests at temperatures 1e-38, 1e-30 and 1e-45 (where the softmax once gave NaN and failed the whole pass)
    in one pass with greedy streams: every request is served, the greedy ones with their own answers, and the tiny
    temperatures sample the argmax, which is the greedy answer too."""
    jobs = [(prompt, 0.0) for prompt in PROMPTS[:3]] + [(prompt, t) for prompt, t in zip(PROMPTS[3:6], (1e-38, 1e-30, 1e-45))]

    def run(job):
        prompt, temperature = job
        seed = 7 if temperature else None
        return _tokens(client.stream(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, temperature=temperature,
                                     seed=seed))

    answers = _in_one_pass(jobs, run)
    for (prompt, temperature), tokens in zip(jobs, answers):
        assert tokens == reference(prompt), (prompt, temperature)


def test_cancelled_stream_leaves_no_session(client):
    stream = client.stream(messages=[("user", PROMPTS[0])], max_new_tokens=200, drafter="eagle", num_draft_tokens=2)
    for _, _chunk in zip(range(3), stream):
        pass
    stream.cancel()
    until("no session left", lambda: _stats("Verify"),
          done=lambda st: st["sessions"] == 0 and st["draft_sessions"] == 0)


LONG = "Count from 1 to 100."  # its answer runs past the budget: the fault strikes mid-request


def test_verify_replica_lost_mid_stream(client, reference):
    """The replica running the loop holds its 4th verify call and is killed: the ingress prefills the prompt and the
    tokens so far again and a fresh loop on the replacement (drafting there too) streams the rest, exactly."""
    recoveries = lambda: _stats("SpecDecodeIngress")["recoveries"].get("verify", 0)  # noqa: E731
    before = recoveries()
    expected = reference(LONG, 64)
    assert len(expected) == 64
    name = arm("Verify", "verify", "hold", after=3)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: list(client.stream(messages=[("user", LONG)], max_new_tokens=64, drafter="eagle",
                                                        num_draft_tokens=2)))
        until("a verify call held", lambda: held("Verify"))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        chunks = answer.result(timeout=BOUND_S)
    assert _tokens(chunks) == expected
    stats = chunks[-1].speculation_stats
    assert stats.drafted > 0 and not stats.fell_back
    assert recoveries() == before + 1
    until("no session left", lambda: _stats("Verify"), done=lambda st: st["sessions"] == 0 and st["draft_sessions"] == 0)


def test_a_repeated_prompt_is_prefilled_by_the_verify_replica(client, reference):
    """limits.local_prefill_tokens (default 2): the same prompt again leaves its last position to the verify replica,
    whose loop's first step computes it in a batched pass and
    draws the first token. Greedy answers stay the target's; a seeded sample is the one a full prefill gives."""
    prompt = "Name three primary colors."  # (sent by no other test: its first request is prefilled in full)
    before = local_prefills()
    for policy in (dict(speculate=False), dict(speculate=False), dict(drafter="model", num_draft_tokens=2)):
        response = client.generate(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, **policy)
        assert list(response.token_ids) == reference(prompt), policy
    assert local_prefills() == before + 2
    for n in (1, 2):  # a request that ends with its first step's token, or one step after it
        assert list(client.generate(messages=[("user", prompt)], max_new_tokens=n, speculate=False).token_ids) == \
            reference(prompt)[:n]
    assert _tokens(client.stream(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, speculate=False)) == \
        reference(prompt)
    assert local_prefills() == before + 5
    sampled = dict(messages=[("user", "Name two planets.")], max_new_tokens=MAX_NEW_TOKENS, temperature=0.9, seed=3,
                   speculate=False)
    full, local = client.generate(**sampled), client.generate(**sampled)
    assert list(local.token_ids) == list(full.token_ids) and local_prefills() == before + 6


def test_verify_replica_lost_at_a_local_prefill(client, reference):
    """The verify replica holding a session's first step (its prompt's last position left to it) is killed: the
    ingress prefills the prompt in full and opens the session again on the replacement; the answer is exact."""
    prompt = "List two kinds of fruit."
    client.generate(messages=[("user", prompt)], max_new_tokens=2, speculate=False)  # (its KV in the prefix cache)
    recoveries = lambda: _stats("SpecDecodeIngress")["recoveries"].get("verify", 0)  # noqa: E731
    before, local = recoveries(), local_prefills()
    name = arm("Verify", "verify", "hold")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: client.generate(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS,
                                                     speculate=False))
        until("a verify call held", lambda: held("Verify"))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        response = answer.result(timeout=BOUND_S)
    assert list(response.token_ids) == reference(prompt)
    assert recoveries() == before + 1 and local_prefills() == local + 1
    until("no session left", lambda: _stats("Verify"), done=lambda st: st["sessions"] == 0)


def test_policy_state_reports_what_the_replica_learned(client):
    """The adaptive policy of a loop in the verify replica learns its costs there; the ingress's policy_state (what
    `splitspec bench grpc` prints) reports them under "verify_replica"."""
    client.generate(messages=[("user", PROMPTS[4])], max_new_tokens=MAX_NEW_TOKENS, drafter="eagle", num_draft_tokens=0)
    state = handle("SpecDecodeIngress").policy_state.remote().result(timeout_s=60)["verify_replica"]["eagle"]
    assert state["verify_ms"] and state["propose_ms"] and state["acceptance_by_position"], state


def test_verify_engine_thread_runs_at_its_configured_niceness(client):
    """stages.verify.engine_nice (0 here) where the process may lower its niceness; else Ray's 15, logged."""
    import os

    verify, prefill = _stats("Verify")["engine_nice"], _stats("Prefill")["engine_nice"]
    may_lower = os.geteuid() == 0  # (or CAP_SYS_NICE / RLIMIT_NICE: not needed here)
    assert (verify == 0) if may_lower else (verify in (0, 15))
    assert prefill >= verify  # (prefill: as Ray starts workers, or 19 once saturated)


def test_a_saturated_engine_thread_runs_at_its_saturated_niceness(client):
    """stages.prefill.saturated_nice (19 here, from passes of one call on): set on the engine thread before the pass."""
    client.generate(messages=[("user", PROMPTS[1])], max_new_tokens=2, speculate=False)
    prefill = _stats("Prefill")
    assert prefill["engine_nice"] == 19 and prefill["engine_nice_switches"] == 1, prefill


def test_replicas_run_their_methods_on_their_own_event_loop(client):
    """config.replica_one_loop (the default): no replica runs its methods on Serve's separate user-code thread, so a
    streamed token crosses no extra thread in the verify replica or the ingress."""
    for deployment in ("SpecDecodeIngress", "Prefill", "Verify"):
        thread = _stats(deployment)["loop_thread"]
        assert "_run_user_code_event_loop" not in thread, (deployment, thread)


def test_a_specbench_sample_through_the_graph(client):
    """Spec-Bench first turns, one of each category (`splitspec bench grpc --prompt-set specbench --check` runs all
    480): EAGLE trees of k = 3 answer every one, greedy, as speculation off does. Its summaries and RAG contexts
    grow their KV buffers inside verify passes, where a side-node path's compaction once failed (issue 36)."""
    from splitspec.bench import grpc as bench_grpc

    report = bench_grpc.run(client, prompt_set="specbench", num_prompts=6, max_new_tokens=32, warmup=0, check=True,
                            policies=["eagle k=3"])  # (drafting every step: the server default may decline here)
    assert report["errors"] == [] and report["mismatches"] == [], report
    assert report["policies"]["eagle k=3"]["drafted"] > 0
    assert set(report["categories"]) == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


def test_the_verify_replica_runs_on_its_cpu_set(client):
    """placement.cpus: the verify replica's engine thread (and every other thread of it) runs on its CPU set only;
    the prefill replica, without one, on every CPU."""
    assert _stats("Verify")["cpus"] == [VERIFY_CPU]
    assert _stats("Prefill")["cpus"] == sorted(os.sched_getaffinity(0))
