"""Bounded per-request session state: at most N sessions and B bytes of KV.

When a new session does not fit, the least recently used (oldest idle)
sessions are evicted; ``reap`` closes sessions nobody has called for a long
time (their request is gone, e.g. with its ingress replica). Touching an
evicted or unknown session raises ``SessionNotFoundError``, never a crash or
a silent wrong answer.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from services.errors import CapacityError, SessionEvictedError, SessionNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 64
DEFAULT_MAX_KV_BYTES = 4 * 2**30  # 4 GiB per engine
# How many evicted ids to remember so that a late call says "evicted", not "unknown".
EVICTED_MEMORY = 1024
EVICTED_FOR_ROOM = "was evicted to make room for newer requests"


class HasKV(Protocol):
    @property
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=HasKV)


class SessionStore(Generic[S]):
    """An LRU map from request id to session state with a session and a byte budget."""

    def __init__(self, *, kind: str, max_sessions: int = DEFAULT_MAX_SESSIONS, max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
                 clock: Callable[[], float] = time.monotonic):
        if max_sessions < 1 or max_kv_bytes < 1:
            raise ValueError("max_sessions and max_kv_bytes must be positive")
        self.kind = kind
        self.max_sessions = max_sessions
        self.max_kv_bytes = max_kv_bytes
        self.clock = clock
        self._sessions: OrderedDict[str, S] = OrderedDict()  # least recently used first
        self._touched: dict[str, float] = {}  # request id -> clock() at its last put / get
        self._evicted: OrderedDict[str, str] = OrderedDict()  # request id -> why it is gone
        self.evictions = 0
        self.reaped = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sessions

    @property
    def kv_bytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def put(self, request_id: str, session: S) -> None:
        """Add a session, evicting the oldest idle ones until it fits."""
        if request_id in self._sessions:
            raise CapacityError(f"{self.kind} session {request_id!r} already exists; request ids must be unique")
        if session.nbytes > self.max_kv_bytes:
            raise CapacityError(
                f"{self.kind} session {request_id!r} needs {session.nbytes} bytes of KV, "
                f"more than the engine's limit of {self.max_kv_bytes}"
            )
        self._sessions[request_id] = session
        self._touched[request_id] = self.clock()
        self._evicted.pop(request_id, None)
        self.enforce_limits(keep=request_id)

    def get(self, request_id: str) -> S:
        """The session for ``request_id``, marked as most recently used."""
        try:
            session = self._sessions[request_id]
        except KeyError:
            if request_id in self._evicted:
                raise SessionEvictedError(
                    f"{self.kind} session {request_id!r} {self._evicted[request_id]}; retry the request"
                ) from None
            raise SessionNotFoundError(f"{self.kind} session {request_id!r} is unknown or already closed") from None
        self._sessions.move_to_end(request_id)
        self._touched[request_id] = self.clock()
        return session

    def pop(self, request_id: str) -> S | None:
        """Remove a session; closing twice or closing an evicted session is fine."""
        self._touched.pop(request_id, None)
        return self._sessions.pop(request_id, None)

    def ids(self, prefix: str = "") -> list[str]:
        """The open sessions' ids that start with ``prefix``."""
        return [request_id for request_id in self._sessions if request_id.startswith(prefix)]

    def reap(self, idle_s: float) -> list[str]:
        """Close the sessions nobody has touched for more than ``idle_s`` (no live request can be that idle: its
        ingress is gone); returns their ids."""
        now, reaped = self.clock(), []
        for request_id in list(self._sessions):  # least recently used first: stop at the first one still in use
            if now - self._touched[request_id] <= idle_s:
                break
            self._forget(request_id, f"was closed after {idle_s:g}s without a call")
            reaped.append(request_id)
        if reaped:
            self.reaped += len(reaped)
            logger.warning("closed %d %s sessions idle for more than %gs", len(reaped), self.kind, idle_s)
        return reaped

    def _forget(self, request_id: str, why: str) -> None:
        self._sessions.pop(request_id)
        self._touched.pop(request_id)
        self._evicted[request_id] = why
        if len(self._evicted) > EVICTED_MEMORY:
            self._evicted.popitem(last=False)

    def enforce_limits(self, keep: str | None = None) -> None:
        """Evict least recently used sessions (never ``keep``) until within both budgets."""
        while len(self._sessions) > self.max_sessions or self.kv_bytes > self.max_kv_bytes:
            victim = next((rid for rid in self._sessions if rid != keep), None)
            if victim is None:
                break
            self._forget(victim, EVICTED_FOR_ROOM)
            self.evictions += 1
            logger.warning("evicted idle %s session %s", self.kind, victim)
