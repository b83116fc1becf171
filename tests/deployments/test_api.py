"""The gRPC request's validation picks the speculation policy: adaptive by default, but a seeded sampled request gets
a pinned k (config ``speculation.seeded_draft_tokens``), so that its seed reproduces the answer."""

import pytest

from deployments import api
from deployments.config import AppConfig
from splitspec.api.client import make_request


@pytest.fixture(scope="module")
def target():
    from services.loading import describe
    from services.models import default_pair

    default_pair.prepare()
    return describe(default_pair.target_dir())


def plan_of(target, config: AppConfig, **kwargs) -> api.Plan:
    return api.parse(make_request("Hello", **kwargs), config, target.tokenizer, max_context=target.max_context,
                     vocab_size=target.vocab_size, default_drafter="eagle")


@pytest.mark.parametrize("kwargs,adaptive,speculate,k", [
    (dict(), True, True, 4),  # greedy: adaptive k up to max_draft_tokens
    (dict(temperature=0.8), True, True, 4),  # sampled without a seed: adaptive too
    (dict(temperature=0.8, seed=7), False, True, 2),  # seeded sampled: k pinned to seeded_draft_tokens
    (dict(temperature=0.0, seed=7), True, True, 4),  # greedy with a seed: nothing random to reproduce
    (dict(temperature=0.8, seed=7, num_draft_tokens=3), False, True, 3),  # the request pins k itself
    (dict(temperature=0.8, seed=7, speculate=False), True, False, 4),  # off: no k at all (stats say not adaptive)
])
def test_speculation_policy_of_a_request(target, kwargs, adaptive, speculate, k):
    plan = plan_of(target, AppConfig(), **kwargs)
    assert (plan.adaptive, plan.speculate, plan.num_draft_tokens) == (adaptive, speculate, k)


def test_seeded_requests_without_speculation_when_configured(target):
    config = AppConfig.model_validate({"speculation": {"seeded_draft_tokens": 0}})
    plan = plan_of(target, config, temperature=0.8, seed=7)
    assert not plan.speculate and not plan.adaptive
    assert plan_of(target, config, temperature=0.8).adaptive  # unseeded requests keep the adaptive policy


@pytest.mark.parametrize("kwargs,want", [
    (dict(), None), (dict(logprobs=True), 0), (dict(logprobs=True, top_logprobs=20), 20),
])
def test_logprobs_of_a_request(target, kwargs, want):
    assert plan_of(target, AppConfig(), **kwargs).params.logprobs == want


@pytest.mark.parametrize("kwargs,message", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs must be an integer in [0, 20]"),
    (dict(top_logprobs=2), "top_logprobs needs logprobs"),
])
def test_logprobs_out_of_range_are_refused(target, kwargs, message):
    from services.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        plan_of(target, AppConfig(), **kwargs)
    assert message in str(err.value)
