"""Every error a request can meet, mapped to a gRPC status in one place (the edge).

Messages are for the user: the original exception's text, never a Ray
traceback or an internal id. Unexpected errors are logged here with their
traceback and reported as INTERNAL with a short reference to that log line.
"""

from __future__ import annotations

import logging
import uuid

import grpc
from ray import exceptions as ray_exceptions
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from services.errors import (
    CapacityError, InvalidRequestError, ModelMismatchError, SessionEvictedError, SessionNotFoundError, SplitspecError,
)

logger = logging.getLogger(__name__)


class StageUnavailableError(SplitspecError):
    """A stage has no replica that can take the call (unplaceable, starting, or gone)."""


class RequestDeadlineError(SplitspecError):
    """The request ran past its time budget."""


class UnauthenticatedError(SplitspecError):
    """The call did not carry the service's bearer token (deployments.auth)."""


class RequestTooLargeError(SplitspecError):
    """A request body over ``limits.max_request_bytes`` (HTTP 413; gRPC's own limit answers RESOURCE_EXHAUSTED)."""


class ModelNotFoundError(SplitspecError):
    """An OpenAI API request names a model this server does not serve (NOT_FOUND: HTTP 404, as OpenAI answers)."""


# Draft-stage failures after which a request goes on without speculation (the answer is the same).
DRAFT_FAILURES = (StageUnavailableError, CapacityError, SessionNotFoundError, ray_exceptions.RayActorError,
                  ray_exceptions.ActorUnavailableError, ray_exceptions.ObjectLostError)


# A stage replica that is gone (killed, OOM, node lost) or that lost the session (restarted): its caller recovers
# (``replica_lost``; a session evicted by a full replica is not one: recovering would evict another).
REPLICA_LOST = (SessionNotFoundError, ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)


def replica_lost(exc: BaseException) -> bool:
    """A stage call failed because its replica is gone or restarted (recoverable), not because it is full."""
    cause = unwrap(exc)
    return isinstance(cause, REPLICA_LOST) and not isinstance(cause, SessionEvictedError)


def unwrap(exc: BaseException) -> BaseException:
    """The exception a stage raised, without Ray's RayTaskError wrapper."""
    while isinstance(exc, ray_exceptions.RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, user-facing message) of an exception raised while serving a request."""
    exc = unwrap(exc)
    if isinstance(exc, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, "unauthenticated"  # nothing more: no hint for a caller without the token
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, RequestTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later"
    if isinstance(exc, BackPressureError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "the server's request queue is full; retry later"
    if isinstance(exc, StageUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, SessionEvictedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} (the server holds too many sessions)"
    if isinstance(exc, SessionNotFoundError):
        return grpc.StatusCode.UNAVAILABLE, f"{exc} (a stage replica restarted or evicted it); retry the request"
    if isinstance(exc, (DeploymentUnavailableError, ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)):
        return grpc.StatusCode.UNAVAILABLE, "a stage replica is unavailable; retry the request"
    if isinstance(exc, (RequestDeadlineError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "the request ran out of time"
    if isinstance(exc, ModelMismatchError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    reference = uuid.uuid4().hex[:8]
    logger.error("internal error %s", reference, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (reference {reference} in the server log)"
