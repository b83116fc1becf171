"""One request's sessions, as the ingress drives them: the prefill call, the KV handoff to a verify session by
reference, the loop's steps streamed back, and every session closed when the request ends.

A request's speculative loop runs in its verify replica, next to the target and its KV (``Verify.open`` starts
it, ``Verify.speculate`` streams its steps); none runs here. Only token ids and a *reference* to the prefill's KV
pass through here; the KV bytes go from the prefill replica to the verifier through the Ray object store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray import exceptions as ray_exceptions
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from deployments import api, calls
from deployments.config import AppConfig
from deployments.metrics import RequestMetrics
from deployments.recovery import StageCalls
from deployments.routing import pin
from deployments.stages import KVHandoff, SessionOpened
from deployments.status import StageUnavailableError, replica_lost, unwrap
from deployments.verify import DraftFallback, DraftResumed, Speculation
from services import drafters
from services.loop import StepOutput
from services.resume import resume_from

logger = logging.getLogger(__name__)

RECENT_HANDOFFS = 64  # KV handoffs remembered for `recent_handoffs` (placement checks, debugging)


@dataclass
class RequestSession:
    """One request's verify session as the ingress holds it; replaced when its replica is lost."""

    verify_sid: str  # the session's id; a reopened session gets a new one (the old may linger on a live replica)
    verify: DeploymentHandle | None = None  # pinned to the replica that holds the session
    stream: DeploymentResponseGenerator | None = None  # Verify.speculate: the loop's steps
    skip_first: bool = False  # a recovered stream: its first token was emitted before the loss
    tokens: list[int] = field(default_factory=list)  # every token emitted so far: the context after the prompt
    recoveries: int = 0
    decided: bool = False  # the first session that opened told the request's policy (a reopened one keeps it)
    # calls opening a session whose answer the request has not taken yet: each is closed once it answers if the
    # request ends first (calls.outside_request)
    openings: dict[asyncio.Task, str] = field(default_factory=dict)  # call -> session id

    def stop_stream(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None


class Decoder:
    """The ingress's half of every request's loop: prefill, open, stream, recover, close."""

    def __init__(self, config: AppConfig, prefill: DeploymentHandle, verify: DeploymentHandle, eos_token_ids,
                 metrics: RequestMetrics, stages: StageCalls):
        self.config, self.prefill, self.verify = config, prefill, verify
        self.eos_token_ids = sorted(eos_token_ids)
        self.metrics, self.stages = metrics, stages
        self.active = 0  # requests between prefill and their last step here (the adaptive policy's load)
        self.handoffs: deque[dict] = deque(maxlen=RECENT_HANDOFFS)

    async def steps(self, plan: api.Plan, timer: api.Timer) -> AsyncIterator[StepOutput]:
        """Prefill, then the request's loop in a verify replica: ``Verify.open`` (by reference: the KV handoff)
        opens its session and starts the loop there, ``Verify.speculate`` (by value) streams its steps; here each
        step is only passed on. A lost prefill or verify replica (or a KV lost with its prefill replica) is
        recovered from without the client noticing: the prompt and every emitted token but the last are prefilled
        again and a fresh loop goes on from that last token (``_recover``)."""
        s = RequestSession(verify_sid=plan.session_id)
        spec = Speculation(plan.max_new_tokens, self.eos_token_ids, plan.prompt_ids,
                           drafter=plan.drafter if plan.speculate else "", num_draft_tokens=plan.num_draft_tokens,
                           adaptive=plan.adaptive, overlap=plan.overlap)
        if spec.drafter and "draft" in self.stages.unplaceable:  # (remote drafting, and no node for the draft stage)
            self._fell_back(plan, "start", self.stages.unplaceable["draft"], StageUnavailableError.__name__)
            spec.drafter = ""
        features = drafters.reads_features(spec.drafter)  # the drafter reads the target's features: prefill them
        params = plan.params
        self.active += 1
        try:
            # (a prompt the prefill's prefix cache holds all but a few positions of leaves them to the verify replica,
            # whose batched pass computes them for little, where a prefill pass reads every weight: limits.local_prefill_tokens)
            local = 0 if features else self.config.limits.local_prefill_tokens
            handoff = await self.stages.retrying(plan, "prefill", lambda: self.prefill.prefill.remote(
                plan.prompt_ids, params, features, local))
            timer.prefill_ms = timer.ms()
            self.metrics.prefilled("verify" if handoff.prompt_rest else "prefill")
            while True:
                try:
                    if s.stream is None:
                        opened = await self.stages.retrying(plan, "verify", lambda: calls.outside_request(
                            lambda: self.verify.open.remote(s.verify_sid, handoff, params, spec), s.openings,
                            s.verify_sid))
                        s.verify = self.verify.options(session_id=pin(opened.replica_id))
                        self._handed_off(handoff, opened, timer)
                        handoff = None  # the last reference here: the object store frees the KV once the verifier holds it
                        if not s.decided:  # (the first session that opened: a loss may come before any did)
                            self._decided(plan, opened)
                            s.decided = True
                        s.stream = s.verify.options(stream=True, _by_reference=False).speculate.remote(s.verify_sid)
                    item = await self.stages.call("verify", anext(s.stream))
                except StopAsyncIteration:
                    return
                except Exception as exc:  # noqa: BLE001 - a lost replica (or KV) is recovered from; anything else is raised
                    s.stop_stream()
                    lost_kv = isinstance(unwrap(exc), ray_exceptions.ObjectLostError)
                    if not (replica_lost(exc) or lost_kv):
                        raise
                    s.recoveries += 1
                    self.stages.lost(plan, "prefill" if lost_kv else "verify", exc, s.recoveries)
                    handoff, params, spec = await self._recover(plan, s, spec, features)
                    continue
                if isinstance(item, DraftFallback):
                    self._fell_back(plan, item.when, f"{item.error} (in the verify replica)", item.error)
                elif isinstance(item, DraftResumed):
                    logger.info("request %s: speculation resumed on a draft replica after %d tokens", plan.request_id,
                                len(s.tokens))
                    self.metrics.recovery("draft")
                    self.stages.recoveries["draft"] += 1
                elif s.skip_first:  # (a recovered stream's first token was emitted before the loss)
                    s.skip_first = False
                else:
                    if s.tokens:  # (prefill's token is no verify step)
                        plan.stats.add(item)
                    else:
                        timer.ttft_ms = timer.ms()
                    s.tokens += item.token_ids
                    yield item
        finally:
            self.active -= 1
            self._close(s)

    async def _recover(self, plan: api.Plan, s: RequestSession, spec: Speculation, features: bool):
        """A fresh session after a loss (services.resume): the handoff of a prefill on a live replica,
        the sampling parameters and the loop's Speculation for it."""
        s.verify_sid = f"{plan.session_id}#{s.recoveries}"
        resume = resume_from(plan.prompt_ids, plan.params, plan.max_new_tokens, s.tokens)
        if resume.last_token is not None:
            spec = dataclasses.replace(spec, max_new_tokens=resume.max_new_tokens, prompt_ids=resume.ids)
        handoff = await self.stages.retrying(plan, "prefill", lambda: self.prefill.prefill.remote(
            resume.ids, resume.params, features))
        if resume.last_token is not None:
            # (prefill's own token is not used, nor its logprob: the stream's first step, that last token, is skipped)
            handoff = dataclasses.replace(handoff, first_token=resume.last_token, first_logprob=None)
            s.skip_first = True
        return handoff, resume.params, spec

    def _close(self, s: RequestSession) -> None:
        """Close every session of the request, outside it: its stream (whose end closes the session on the
        replica), a session whose stream never started, and sessions whose replica the request never learnt
        (closed once their open call answers, wherever they opened)."""
        s.stop_stream()
        timeout = self.config.limits.stage_timeout_s
        if s.verify is not None:
            verify, sid = s.verify, s.verify_sid
            calls.detached(lambda: verify.close.remote(sid), timeout)
        for call, opening_sid in s.openings.items():
            calls.detached(lambda call=call, sid=opening_sid: self._close_when_opened(sid, call), timeout)

    async def _close_when_opened(self, sid: str, opening: asyncio.Task) -> None:
        """Close verify session ``sid`` once the call ``opening`` it has answered. (A cancelled open closes the
        session itself, on the replica: ``_Stage._open_session``.)"""
        try:
            opened = await opening
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the session never opened (or closed itself)
            return
        await self.verify.options(session_id=pin(opened.replica_id)).close.remote(sid)

    def _decided(self, plan: api.Plan, opened: SessionOpened) -> None:
        """What the verify replica decided for the request: declined by the gate, pre-drafting or not."""
        plan.overlap = opened.overlap
        if opened.declined:
            plan.declined = True
            self.metrics.declined(opened.declined)

    def _handed_off(self, handoff: KVHandoff, opened: SessionOpened, timer: api.Timer) -> None:
        """Record a KV handoff prefill -> verify: its latency and bytes (metrics, timings, ``handoffs``)."""
        timer.kv_handoff_ms = opened.handoff_ms
        self.metrics.kv_handoff(opened.resolved_bytes, opened.handoff_ms / 1000)
        self.handoffs.append({
            "kv_bytes": handoff.kv_bytes,
            "prefill_node": handoff.prefill_node,
            "verify_node": opened.node_id,
            "resolved_bytes": opened.resolved_bytes,
            "handoff_ms": opened.handoff_ms,
        })

    def _fell_back(self, plan: api.Plan, when: str, cause, kind: str) -> None:
        logger.warning("request %s: draft stage failed at %s (%s); continuing without speculation", plan.request_id, when, cause)
        self.metrics.fallback(f"{when}: {kind}")
        plan.fallback = True
