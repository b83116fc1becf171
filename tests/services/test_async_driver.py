"""``services.loop.execute_async``, the round executor of the asyncio driver (the verify replica's loop), on the
tiny pair: a loop driven by it equals the target alone, also when the drafter fails mid-request, and an error of a
call is raised only after the other call of its round has ended."""

import asyncio

import pytest

from services.loop import SpeculativeLoop, StepOutput, execute_async
from services.policy import AdaptiveK, CostModel
from services.sampling import SamplingParams
from tests.conftest import greedy_reference
from tests.services.test_engine import NEW_TOKENS, PROMPTS


async def _decode(prefill, draft, verify, prompt, *, k, policy=None, fail_at=None) -> tuple[list[int], SpeculativeLoop]:
    params = SamplingParams()
    result = prefill.prefill(prompt, params)
    draft.start("r", prompt, params, "model")
    verify.open("r", result.payload, result.first_token, params)
    proposals = 0

    async def propose(p):
        nonlocal proposals
        proposals += 1
        if proposals == fail_at:
            return None  # the draft stage failed: the target alone from here
        return draft.propose("r", p.k, p.forced, p.guesses, p.accepts)

    async def verify_(v):
        await asyncio.sleep(0)
        return verify.verify("r", v.draft_ids, v.probs)

    loop = SpeculativeLoop(result.first_token, max_new_tokens=NEW_TOKENS, eos=prefill.target.eos_token_ids,
                           num_draft_tokens=k, drafting=True, policy=policy)
    tokens, results = [], None
    try:
        while (item := loop.advance(results)) is not None:
            if isinstance(item, StepOutput):
                tokens += item.token_ids
                results = None
            else:
                results = await execute_async(item, propose, verify_)
    finally:
        verify.close("r")
        draft.close("r")
    return tokens, loop


@pytest.mark.parametrize("k,adaptive,fail_at", [(1, False, None), (3, False, None), (2, False, 3), (4, True, None)])
def test_greedy_equals_target_alone(tiny, tiny_engines, k, adaptive, fail_at):
    target, _ = tiny
    for prompt in PROMPTS[:4]:
        policy = AdaptiveK(CostModel(), k_max=k) if adaptive else None
        tokens, loop = asyncio.run(_decode(*tiny_engines, prompt, k=k, policy=policy, fail_at=fail_at))
        assert tokens == greedy_reference(target.model, prompt, NEW_TOKENS), prompt
        assert loop.stats.drafted > 0
        assert loop.drafting == (fail_at is None)  # a failed proposal turns drafting off for good
        if fail_at is not None:
            assert loop.stats.drafted <= (fail_at - 1) * k


def test_an_error_is_raised_after_the_other_call_ends():
    ended = []

    async def propose(p):
        await asyncio.sleep(0.05)
        ended.append("propose")
        return None

    async def verify(v):
        raise RuntimeError("verify failed")

    from services.loop import Calls, Propose, Verify

    with pytest.raises(RuntimeError, match="verify failed"):
        asyncio.run(execute_async(Calls(propose=Propose(1, []), verify=Verify([], None)), propose, verify))
    assert ended == ["propose"]
