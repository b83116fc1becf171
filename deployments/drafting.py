"""Where a verify replica's loop gets its drafts: its own drafter, or the draft stage (``speculation.drafting``).

Both drive one request's draft session of a drafter kind (services.drafters)
and take the loop's ``Propose``:

- ``LocalDrafting``: the verify replica's own DraftEngine, on the target's
  device and engine thread; a step's proposal is drafted in the batched pass
  right before its verification (one engine call a step: services.chained).
- ``RemoteDrafting``: a session on a draft-stage replica, asked directly,
  replica to replica; the loop may pre-draft the next block there while this
  one is verified (services.loop, ``overlap``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from ray.serve.handle import DeploymentHandle

from deployments import calls
from deployments.routing import pin
from services import drafters
from services.chained import ChainedCall
from services.draft import DraftProposal, ProposeCall
from services.loop import Propose
from services.sampling import SamplingParams

LOCAL, REMOTE = "local", "remote"


class Drafting(Protocol):
    where: str  # LOCAL or REMOTE

    async def start(self, prompt_ids: list[int], params: SamplingParams, drafter: str, handoff) -> None:
        """Open the request's draft session over ``prompt_ids`` (``handoff``: the prefill's, with the prompt's
        features for a kind that reads them)."""

    def close(self) -> None:
        """Close the session without waiting (also from a cancelled task)."""


class LocalDrafting:
    """A session of the verify replica's own DraftEngine (``replica.drafts``), on its engine thread; its proposals
    go through the replica's batched passes, each right before its verification (``propose_and_verify``)."""

    where = LOCAL

    def __init__(self, replica, session_id: str):
        self.replica, self.session_id = replica, session_id
        self.open, self.kind = False, None

    async def start(self, prompt_ids: list[int], params: SamplingParams, drafter: str, handoff) -> None:
        features = await handoff.feature_refs[0] if handoff.feature_refs else None
        await self.replica._run(self.replica.drafts.start, self.session_id, prompt_ids, params, drafter, features)
        self.open, self.kind = True, drafters.get(drafter)

    async def propose_and_verify(self, p: Propose):
        """The proposal and the verification of its drafts in one call of the batched passes (ChainedResult)."""
        call = ProposeCall(self.session_id, p.k, list(p.forced), p.guesses, list(p.accepts), p.width, p.jump)
        return await self.replica.batcher.submit(ChainedCall(call, self.kind.verify_rows(p.k, p.width) + p.jump))

    def close(self) -> None:
        if self.open:  # (on the engine thread: after a start still running there)
            self.replica._executor.submit(self.replica.drafts.close, self.session_id)
            self.open = False


class RemoteDrafting:
    """A draft session on a draft-stage replica, pinned there once it is open."""

    where = REMOTE

    def __init__(self, draft: DeploymentHandle, session_id: str, timeout_s: float):
        self.draft, self.session_id, self.timeout_s = draft, session_id, timeout_s
        self.base_id, self.starts = session_id, 0
        self.session: DeploymentHandle | None = None  # pinned to the replica that holds the session

    async def start(self, prompt_ids: list[int], params: SamplingParams, drafter: str, handoff) -> None:
        self.close()  # (a restart after a lost replica: the old session, if its replica is alive after all)
        self.starts += 1
        if self.starts > 1:  # a fresh id: a close of the old one routed to the replacement must not close this one
            self.session_id = f"{self.base_id}#{self.starts}"
        response_id = self.session_id
        response = self.draft.start.remote(response_id, prompt_ids, params, drafter, handoff)
        call = asyncio.ensure_future(calls.awaited(response))  # (shielded below: a cancelled wait leaves it running)
        try:
            opened = await asyncio.wait_for(asyncio.shield(call), timeout=self.timeout_s)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            # the loop ended, or the replica is slow: the session may still open there; close it once it has
            calls.detached(lambda: self._close_when_opened(call, response_id), self.timeout_s)
            raise
        self.session = self.draft.options(session_id=pin(opened.replica_id))

    async def _close_when_opened(self, call: asyncio.Future, session_id: str) -> None:
        try:
            opened = await call
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - it never opened (or its replica closed it)
            return
        await self.draft.options(session_id=pin(opened.replica_id)).close.remote(session_id)

    async def propose(self, p: Propose) -> DraftProposal:
        return await self._call(self.session.propose.remote(self.session_id, p.k, p.accepts, p.forced, p.guesses, p.width,
                                                            p.jump))

    async def answers(self) -> bool:
        """Whether a draft replica answers a call, asking until ``timeout_s`` (a lost replica's replacement)."""
        waits, give_up = calls.backoff(), time.monotonic() + self.timeout_s
        while time.monotonic() < give_up:
            try:
                await self._call(self.draft.ping.remote())
                return True
            except Exception:  # noqa: BLE001 - the lost replica, or none yet: ask again
                await asyncio.sleep(next(waits))
        return False

    def close(self) -> None:
        session, session_id, self.session = self.session, self.session_id, None
        if session is not None:
            calls.detached(lambda: session.close.remote(session_id), self.timeout_s)

    async def _call(self, response):
        return await calls.within(response, self.timeout_s)
