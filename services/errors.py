"""Typed errors raised by the engine; the serving edge maps each to a gRPC status.

The mapping lives in one place (``deployments``): ``InvalidRequestError`` is
INVALID_ARGUMENT (``InvalidGrammarError`` too, being one), ``GrammarStateError``
INTERNAL, ``CapacityError`` RESOURCE_EXHAUSTED, ``SessionNotFoundError``
and ``ModelMismatchError`` are server-side faults (INTERNAL or a retry).
"""


class SplitspecError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(SplitspecError, ValueError):
    """The request itself is wrong (empty prompt, k out of range, ...); the user can fix it."""


class InvalidGrammarError(InvalidRequestError):
    """The request's JSON schema (or grammar) cannot be compiled; the message says why (HTTP 400, INVALID_ARGUMENT)."""


class GrammarStateError(SplitspecError):
    """A grammar state was asked to take a token its grammar forbids, or to roll back past its start: tokens come
    from masked distributions, so this is a server-side fault (INTERNAL), never the user's."""


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
