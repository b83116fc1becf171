"""Continuous batching of one replica's engine calls (asyncio, no Ray).

Calls queue while the engine runs a pass; when it ends, every queued call
that fits joins the next pass at once. A lone call starts at once: there is
no batching window to wait out, so a single stream pays nothing for it
(vLLM's scheduler and Ray Serve's ``@serve.batch`` with a zero wait are the
models; ``@serve.batch`` is not used because it batches by count, not by
rows, and cannot keep two calls of one session out of the same pass).
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
                 on_pass: Callable[[PassStats], None] | None = None):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self._run_pass = run_pass
        self.max_rows = max_rows
        self._on_pass = on_pass
        self._queue: list[tuple[C, asyncio.Future]] = []
        self._draining = False

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, call: C) -> R:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((call, future))
        if not self._draining:
            self._draining = True
            asyncio.create_task(self._drain())
        return await future

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
            while batch := self._next_batch():
                calls = [call for call, _ in batch]
                try:
                    results = await self._run_pass(calls)
                except Exception as exc:  # the pass itself failed: every call in it gets the error
                    results = [exc] * len(batch)
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
