"""`splitspec bench grpc`'s ideal for the measured costs: drafting charged at its fastest measured cost."""

import pytest

from services.policy import CostModel, describe
from splitspec.bench.grpc import add_drafting_ideal


def _report():
    policy = lambda tok_s, ideal, tokens, steps, drafted, drafter: {  # noqa: E731
        "tok_s": tok_s, "ideal_tok_s": ideal, "tokens": tokens, "steps": steps, "drafted": drafted, "drafter": drafter}
    return {"policies": {"off": policy(40.0, 40.0, 512, 0, 0, None), "eagle k=2": policy(60.0, 72.0, 512, 270, 1080, "eagle"),
                         "server default": policy(58.0, 70.0, 512, 280, 900, "eagle"),
                         "prompt_lookup k=3": policy(30.0, 45.0, 512, 400, 300, "prompt_lookup")}}


def test_drafting_is_charged_at_the_fastest_cost_per_chain_token():
    costs = CostModel()
    for k, seconds in ((1, 0.0030), (1, 0.0022), (2, 0.0050), (2, 0.0041)):
        costs.observe_propose(k, seconds)
    assert costs.min_propose_s == {1: 0.0022, 2: 0.0041}
    state = {"verify_replica": {"eagle": describe(costs, None)}, "eagle": describe(CostModel(), None)}
    report = _report()
    add_drafting_ideal(report, state, tree_width=3)
    k2 = report["policies"]["eagle k=2"]
    seconds = 512 / 72.0 + 1080 / 3 * 0.00205  # a chain token at least 4.1 ms / 2
    assert k2["ideal_with_drafting_tok_s"] == pytest.approx(512 / seconds, abs=0.01)
    assert k2["fraction_of_ideal_with_drafting"] == pytest.approx(60.0 * seconds / 512, abs=1e-3)
    assert k2["ideal_with_drafting_tok_s"] < k2["ideal_tok_s"]  # still an upper bound, tighter than drafting free
    assert "ideal_with_drafting_tok_s" in report["policies"]["server default"]  # the server's drafter: eagle
    assert "ideal_with_drafting_tok_s" not in report["policies"]["off"]  # nothing drafted
    assert "ideal_with_drafting_tok_s" not in report["policies"]["prompt_lookup k=3"]  # no model cost measured


def test_no_measured_proposal_leaves_the_report_as_it_is():
    report = _report()
    add_drafting_ideal(report, {"verify_replica": {"error": "unreachable"}}, tree_width=3)
    assert all("ideal_with_drafting_tok_s" not in r for r in report["policies"].values())
