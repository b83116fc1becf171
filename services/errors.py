"""Typed errors raised by the engine; the serving edge maps each to a gRPC status.

The mapping lives in one place (``deployments``): ``InvalidRequestError`` is
INVALID_ARGUMENT, ``CapacityError`` RESOURCE_EXHAUSTED, ``SessionNotFoundError``
and ``ModelMismatchError`` are server-side faults (INTERNAL or a retry).
"""


class SplitspecError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(SplitspecError, ValueError):
    """The request itself is wrong (empty prompt, k out of range, ...); the user can fix it."""


class SessionNotFoundError(SplitspecError, KeyError):
    """A draft or verify session is unknown: never opened, already closed, or evicted."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "session not found"


class SessionEvictedError(SessionNotFoundError):
    """The session was evicted to make room for others, or closed after a long time without a call: its replica is
    alive but full (not a lost replica to recover from)."""


class ModelMismatchError(SplitspecError):
    """Two models (or a KV payload and a model) that must match do not."""


class CapacityError(SplitspecError):
    """A bounded resource (sessions, KV bytes) cannot take this request."""
