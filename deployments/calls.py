"""Calls from one replica to another through Serve handles: awaited within a deadline, retried with backoff while a
lost replica is replaced, and made outside the request where they must outlive it.

Serve cancels the stage calls a request has made once the request is cancelled or has ended. A session's close
must still go out, and a call that opens a session must not be cancelled as its answer comes (the replica would
have opened a session nobody closes): those run here, with no request context (``detached``, ``outside_request``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterator

logger = logging.getLogger(__name__)

RETRY_BACKOFF_S = (0.1, 2.0)  # first and longest wait between calls to a stage that has just lost a replica


async def awaited(response: Awaitable):
    """A Serve response (or a stream's next item) as a coroutine, which ``asyncio.wait_for`` and tasks take."""
    return await response


async def within(response, timeout_s: float):
    """Await a stage call; one that has not answered in ``timeout_s`` is cancelled, and TimeoutError raised."""
    try:
        return await asyncio.wait_for(awaited(response), timeout=timeout_s)
    except asyncio.TimeoutError:
        if hasattr(response, "cancel"):  # a response (wait_for cancelled a stream's pending item itself)
            response.cancel()
        raise


def backoff() -> Iterator[float]:
    """The waits between tries of a call whose replica was lost: RETRY_BACKOFF_S[0], doubling, at most [1]."""
    delay = RETRY_BACKOFF_S[0]
    while True:
        yield delay
        delay = min(2 * delay, RETRY_BACKOFF_S[1])


_detached: set[asyncio.Task] = set()  # calls that outlive their request (asyncio holds tasks only weakly)


def detached(make_call: Callable[[], Awaitable], timeout_s: float) -> None:
    """Run ``make_call()`` (a stage call, or a coroutine making them) to its end in a task of its own, outside the
    request, within ``timeout_s``. Errors are logged, never raised: a replica gone, or a session closed already,
    leaves nothing to close."""
    async def run():
        try:
            await asyncio.wait_for(awaited(make_call()), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001
            logger.debug("detached call failed: %s", exc)

    task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())  # no request context
    _detached.add(task)
    task.add_done_callback(_detached.discard)


class Opening:
    """The awaitable answer of a call opening a session, made outside the request (``outside_request``). Awaiting it
    to its end hands the session to the request, which takes it out of ``openings``; a cancelled await leaves the
    call running, and the session in ``openings`` for whoever closes what the request never learnt of."""

    def __init__(self, call: asyncio.Task, openings: dict):
        self.call, self.openings = call, openings

    def __await__(self):
        opened = yield from asyncio.shield(self.call).__await__()
        self.openings.pop(self.call, None)
        return opened


def outside_request(make_call: Callable[[], Awaitable], openings: dict, session_id: str) -> Opening:
    """The call ``make_call()`` opening session ``session_id``, made with no request context, so that Serve does
    not cancel it with the request; it is in ``openings`` (task -> session id) until awaited to its end."""
    response = contextvars.Context().run(make_call)  # no request context: not a child call of the request
    call = asyncio.get_running_loop().create_task(awaited(response), context=contextvars.Context())
    openings[call] = session_id
    return Opening(call, openings)
