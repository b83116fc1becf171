"""Experimental speculation.verify_driven: the loop runs in the verify replica (Verify.speculate). Greedy output
equals the target alone through gRPC; a stream cancelled mid-way leaves no session."""

import pytest

from tests.serving.conftest import MAX_NEW_TOKENS, PROMPTS, handle, make_config, serving, until

pytestmark = pytest.mark.slow

POLICIES = [dict(speculate=True, drafter=drafter, num_draft_tokens=k)
            for drafter in ("model", "eagle", "prompt_lookup") for k in (0, 1, 3)]  # k = 0: adaptive


@pytest.fixture(scope="module")
def client():
    with serving(make_config(speculation={"verify_driven": True, "colocate_drafter": False})) as client:
        yield client


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p['drafter']}-k{p['num_draft_tokens']}")
def test_greedy_equals_target_alone(client, reference, policy):
    for prompt in PROMPTS:
        response = client.generate(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, **policy)
        assert list(response.token_ids) == reference(prompt), prompt
        stats = response.speculation_stats
        assert stats.accepted <= stats.drafted
    assert handle("Verify").stats.remote().result(timeout_s=60)["opened"] > 0


def test_cancelled_stream_leaves_no_session(client):
    stream = client.stream(messages=[("user", PROMPTS[0])], max_new_tokens=200, drafter="eagle", num_draft_tokens=2)
    for _, _chunk in zip(range(3), stream):
        pass
    stream.cancel()
    until("no session left", lambda: [handle(d).stats.remote().result(timeout_s=60)["sessions"]
                                      for d in ("Draft", "Verify")], done=lambda n: n == [0, 0])
