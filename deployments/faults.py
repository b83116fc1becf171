"""Test-only fault injection in stage replicas (config ``faults.enabled``): deterministic, no sleeps or races.

A test arms one replica through its handle, ``arm_fault(method, action, after)``:
the replica's call of ``method`` number ``after + 1`` from then on

- ``exit``: ends the replica's process at once — to its callers, what an OOM
  kill or a lost node looks like (Serve then starts a replacement);
- ``hold``: never returns until ``release_fault()`` — a stage that hangs
  (while it holds, the test may kill the replica through Ray).

A fault fires once; a replica Serve starts in place of a dead one is not armed.
With ``faults.enabled`` off (the default) arming is refused.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

EXIT, HOLD = "exit", "hold"
ACTIONS = (EXIT, HOLD)


class FaultsDisabledError(RuntimeError):
    """arm_fault() on a deployment whose config leaves faults.enabled off."""


@dataclass
class _Armed:
    method: str
    action: str
    calls_left: int  # calls of ``method`` that go through before the fault fires


class FaultPoints:
    """The fault points of one replica: each engine-facing method awaits ``point(its name)`` first."""

    def __init__(self, enabled: bool, methods: tuple[str, ...]):
        self.enabled = enabled
        self.methods = methods
        self.armed: _Armed | None = None
        self.held = 0  # calls holding now
        self._released = asyncio.Event()

    def arm(self, method: str, action: str, after: int = 0) -> None:
        if not self.enabled:
            raise FaultsDisabledError("fault injection is for tests only: set faults.enabled in the app config")
        if method not in self.methods or action not in ACTIONS or after < 0:
            raise ValueError(f"arm_fault: method in {self.methods}, action in {ACTIONS}, after >= 0; "
                             f"got {method!r}, {action!r}, {after!r}")
        self.armed = _Armed(method, action, after)
        if self._released.is_set():  # (a call still held keeps waiting for release())
            self._released = asyncio.Event()

    def release(self) -> None:
        """Let every held call go on, and disarm."""
        self.armed = None
        self._released.set()

    async def point(self, method: str) -> None:
        armed = self.armed
        if armed is None or armed.method != method:
            return
        if armed.calls_left > 0:
            armed.calls_left -= 1
            return
        self.armed = None
        if armed.action == EXIT:
            os._exit(1)  # no cleanup, no reply: the process is gone
        self.held += 1
        try:
            await self._released.wait()
        finally:
            self.held -= 1
