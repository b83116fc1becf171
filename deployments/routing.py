"""Session affinity: every call of a request reaches the draft / verify replica that holds its session.

A session's first call (``start`` / ``open``) is routed like any request (the
less loaded of two random replicas) and returns the replica's id; the ingress
then sends every later call with ``handle.options(session_id=pin(replica_id))``
and this router picks exactly that replica. No routing table is kept, so it
holds for any number of ingress replicas and routers, and it does not rely on
Serve's internal request id (which concurrent calls inside one parent request
share). If the pinned replica is gone, the call goes to any replica, whose
engine answers "session not found" (UNAVAILABLE at the edge) instead of hanging.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PIN_PREFIX = "replica:"
ROUTER_CLASS = "deployments.routing.SessionAffinityRouter"


def pin(replica_id: str) -> str:
    """The session_id that routes a call to ``replica_id`` (a ReplicaID.unique_id)."""
    return PIN_PREFIX + replica_id


class SessionAffinityRouter(RequestRouter):
    """Pinned calls go to their replica; others to the less loaded of two random replicas."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if session and session.startswith(PIN_PREFIX):
            wanted = session[len(PIN_PREFIX) :]
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
            if pinned:
                return [pinned]
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]
