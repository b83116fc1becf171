"""Continuous batching of one replica's engine calls (asyncio, no Ray).

Calls queue while the engine runs a pass; when it ends, every queued call
that fits joins the next pass. A lone call starts at once: there is no
batching window to wait out, so a single stream pays nothing for it (vLLM's
scheduler and Ray Serve's ``@serve.batch`` are the models; ``@serve.batch``
is not used because it batches by count, not by rows, and cannot keep two
calls of one session out of the same pass).

One wait remains, and it is what makes batching pay across a network hop:
the sessions a pass answers come back with their next call a hop later,
just after the next pass would have started without them. Started at once,
the passes settle into two alternating half-batches. So after a pass the
batcher waits for the sessions it answered — until all are back, they close
(``forget``), or ``gather_fraction`` of the pass's time has gone (at most
``gather_max_s``) — and then runs them together with everyone queued. A
session being opened is waited for the same way (``expect``): its first call
comes a moment after its open, which runs between two passes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class BatchCall(Protocol):
    request_id: str

    @property
    def rows(self) -> int: ...


C = TypeVar("C", bound=BatchCall)
GATHER_FRACTION = 0.5  # after a pass, wait for its sessions' next calls up to this share of its time ...
GATHER_MAX_S = 0.04  # ... and at most this long (a hop in the graph takes a few ms)
R = TypeVar("R")


@dataclass
class PassStats:
    """What one pass took: for the batch-size histograms."""

    calls: int
    rows: int


class ContinuousBatcher(Generic[C, R]):
    """Runs ``run_pass(calls) -> results`` (one result or exception per call) with every call waiting.

    A pass takes queued calls in arrival order up to ``max_rows`` rows (a call larger than that runs alone)
    and at most one call per session; the rest wait for the next pass.
    """

    def __init__(self, run_pass: Callable[[list[C]], Awaitable[list[R | Exception]]], *, max_rows: int,
                 on_pass: Callable[[PassStats], None] | None = None, gather_fraction: float = GATHER_FRACTION,
                 gather_max_s: float = GATHER_MAX_S):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self._run_pass = run_pass
        self.max_rows = max_rows
        self._on_pass = on_pass
        self.gather_fraction, self.gather_max_s = gather_fraction, gather_max_s
        self._queue: list[tuple[C, asyncio.Future]] = []
        self._draining = False
        self._drainer: asyncio.Task | None = None
        self._expected: set[str] = set()  # sessions the last pass answered that have not called again
        self._joining: set[str] = set()  # sessions about to make their first call (``expect``)
        self._gather_until = 0.0  # event-loop time until which a pass waits for them
        self._returned = asyncio.Event()
        self.passes = 0
        self.largest_pass = 0  # most calls one pass took

    async def submit(self, call: C) -> R:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((call, future))
        self._back(call.request_id)
        if not self._draining:
            self._draining = True
            self._drainer = asyncio.create_task(self._drain())  # keep a reference: the loop holds tasks weakly
        return await future

    @property
    def queued(self) -> int:
        """Calls waiting for a pass."""
        return sum(not future.done() for _, future in self._queue)

    def expect(self, request_id: str) -> None:
        """A session will make its first call soon (it is being opened): the next pass waits for it (within the
        same bound) as for one the last pass answered."""
        self._joining.add(request_id)
        self._expected.add(request_id)
        self._returned.clear()

    def forget(self, request_id: str) -> None:
        """The session closed: the next pass does not wait for it."""
        self._back(request_id)

    def _back(self, request_id: str) -> None:
        self._joining.discard(request_id)
        self._expected.discard(request_id)
        if not self._expected:
            self._returned.set()

    async def _gather(self) -> None:
        """Before a pass: wait (briefly) for the sessions the last pass answered, so that they share this one."""
        loop = asyncio.get_running_loop()
        while self._expected and (left := self._gather_until - loop.time()) > 0:
            self._returned.clear()
            try:
                await asyncio.wait_for(self._returned.wait(), left)
            except asyncio.TimeoutError:
                break
        self._expected.clear()

    def _next_batch(self) -> list[tuple[C, asyncio.Future]]:
        batch, rest, rows, sessions = [], [], 0, set()
        for call, future in self._queue:
            if future.done():  # its caller was cancelled while it waited
                continue
            fits = not batch or rows + call.rows <= self.max_rows
            if fits and call.request_id not in sessions:
                batch.append((call, future))
                rows += call.rows
                sessions.add(call.request_id)
            else:
                rest.append((call, future))
        self._queue = rest
        return batch

    async def _drain(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            while True:
                await self._gather()
                if not (batch := self._next_batch()):
                    return
                calls = [call for call, _ in batch]
                start = loop.time()
                try:
                    results = await self._run_pass(calls)
                except Exception as exc:  # the pass itself failed: every call in it gets the error
                    results = [exc] * len(batch)
                queued = {call.request_id for call, _ in self._queue}
                self._expected = ({call.request_id for call in calls} - queued) | self._joining
                self._joining.clear()  # (waited for after one pass at most: one that never calls costs one wait)
                self._gather_until = loop.time() + min(self.gather_max_s, self.gather_fraction * (loop.time() - start))
                self.passes += 1
                self.largest_pass = max(self.largest_pass, len(calls))
                if self._on_pass is not None:
                    self._on_pass(PassStats(len(calls), sum(call.rows for call in calls)))
                for (_, future), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._draining = False
