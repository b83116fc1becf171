"""The ingress's calls to its stages, and recovery from a lost stage replica without the client noticing.

A stage call that finds its replica lost is made again (Serve routes it to a live replica or waits for the
replacement) until ``limits.stage_timeout_s`` after the loss; a lost verify replica, or a KV lost with its prefill
replica, is recovered from by prefilling again what the request had and opening a fresh loop (deployments.decoding,
services.resume).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from deployments import api, calls
from deployments.config import AppConfig
from deployments.metrics import RequestMetrics
from deployments.status import StageUnavailableError, replica_lost, unwrap

logger = logging.getLogger(__name__)

MAX_RECOVERIES = 3  # replicas one request may lose and recover from; one more fails it with UNAVAILABLE


class StageCalls:
    """Every call of the ingress to a stage: awaited within ``stage_timeout_s`` (then UNAVAILABLE, not a hang),
    refused at once for a stage no node can host (``unplaceable``, kept by the ingress's placement watch), and,
    with ``retrying``, made again while its replica is replaced. Lost replicas are logged once and counted."""

    def __init__(self, config: AppConfig, metrics: RequestMetrics):
        self.config, self.metrics = config, metrics
        self.unplaceable: dict[str, str] = {}  # stage -> why no node can host it
        self.recoveries: dict[str, int] = defaultdict(int)  # lost stage replicas recovered from, by stage

    async def call(self, stage: str, response):
        """Await a stage call (a response, or a stream's next item)."""
        if stage in self.unplaceable:
            raise StageUnavailableError(self.unplaceable[stage])
        timeout = self.config.limits.stage_timeout_s
        start = time.perf_counter()
        try:
            result = await calls.within(response, timeout)
        except asyncio.TimeoutError:
            raise StageUnavailableError(f"stage {stage!r} did not answer within {timeout:g}s") from None
        self.metrics.stage_call(stage, time.perf_counter() - start)
        return result

    async def retrying(self, plan: api.Plan, stage: str, make_call: Callable):
        """The result of ``make_call()``; while its replica is lost, call again until ``stage_timeout_s`` after
        the loss."""
        waits, give_up = calls.backoff(), None
        while True:
            try:
                return await self.call(stage, make_call())
            except Exception as exc:  # noqa: BLE001 - only a lost replica is retried
                if not replica_lost(exc):
                    raise
                if give_up is None:
                    self.lost(plan, stage, exc)
                    give_up = time.monotonic() + self.config.limits.stage_timeout_s
                if time.monotonic() > give_up:
                    raise StageUnavailableError(f"stage {stage!r} lost its replica and no other answered within "
                                                f"{self.config.limits.stage_timeout_s:g}s") from exc
                await asyncio.sleep(next(waits))

    def lost(self, plan: api.Plan, stage: str, exc: BaseException, recoveries: int = 0) -> None:
        """Log a lost replica and count its recovery; a request that has lost more than MAX_RECOVERIES fails
        (UNAVAILABLE). ``recoveries``: how many this request has lost, this one included (0: not counted)."""
        if recoveries > MAX_RECOVERIES:
            raise StageUnavailableError(f"the request lost more than {MAX_RECOVERIES} stage replicas; retry it") from exc
        logger.warning("request %s: %s replica lost (%s: %s); recovering", plan.request_id, stage,
                       type(unwrap(exc)).__name__, unwrap(exc))
        self.metrics.recovery(stage)
        self.recoveries[stage] += 1
