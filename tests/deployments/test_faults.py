"""The test-only fault points (deployments.faults) and the client's retry rule, without a cluster."""

import asyncio

import grpc
import pytest

from deployments.faults import EXIT, HOLD, FaultPoints, FaultsDisabledError
from splitspec.api.client import retryable


def test_arming_is_refused_unless_enabled():
    with pytest.raises(FaultsDisabledError, match="faults.enabled"):
        FaultPoints(False, ("verify",)).arm("verify", HOLD)
    with pytest.raises(ValueError, match="method in"):
        FaultPoints(True, ("verify",)).arm("prefill", HOLD)
    with pytest.raises(ValueError, match="action in"):
        FaultPoints(True, ("verify",)).arm("verify", "explode")


def test_hold_fires_once_at_the_chosen_call_and_release_lets_it_go():
    async def scenario():
        faults = FaultPoints(True, ("open", "verify"))
        faults.arm("verify", HOLD, after=2)
        await faults.point("open")  # another method: not counted
        await faults.point("verify")
        await faults.point("verify")
        third = asyncio.ensure_future(faults.point("verify"))
        await asyncio.sleep(0)
        assert faults.held == 1 and not third.done()
        await faults.point("verify")  # fired once: later calls go through
        faults.release()
        await asyncio.wait_for(third, 5)
        assert faults.held == 0

    asyncio.run(scenario())


def test_exit_is_armed_not_fired_early():
    async def scenario():
        faults = FaultPoints(True, ("verify",))
        faults.arm("verify", EXIT, after=1)
        await faults.point("verify")  # the first call goes through; the second would end the process
        assert faults.armed is not None and faults.armed.calls_left == 0

    asyncio.run(scenario())


class _Error(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code,details,retry", [
    (grpc.StatusCode.UNAVAILABLE, "no replica", True),
    (grpc.StatusCode.INTERNAL, "The actor died unexpectedly before finishing this task.", True),  # Ray 2.60's proxy
    (grpc.StatusCode.INTERNAL, "internal error (reference 1234abcd in the server log)", False),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", False),
])
def test_client_retries_only_a_lost_or_missing_ingress(code, details, retry):
    assert retryable(_Error(code, details)) is retry


def test_a_full_replica_is_not_a_lost_one():
    """A session evicted to make room is not recovered from (reopening it would evict another)."""
    from ray import exceptions as ray_exceptions

    from deployments.status import replica_lost, to_status
    from services.errors import SessionEvictedError, SessionNotFoundError

    evicted = SessionEvictedError("verify session 'x' was evicted to make room for newer requests; retry the request")
    assert not replica_lost(evicted)
    assert to_status(evicted)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert replica_lost(SessionNotFoundError("verify session 'x' is unknown or already closed"))
    assert replica_lost(ray_exceptions.ActorUnavailableError("gone", b"0" * 16))
