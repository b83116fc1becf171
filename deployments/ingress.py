"""The ingress: gRPC methods of splitspec.v1.SpecDecode (and the OpenAI-compatible routes): admission, parsing, the
prefill call, the KV handoff by reference, streaming back, and recovery from lost replicas.

A request's speculative loop runs in its verify replica, next to the target and its KV (``Verify.open`` starts
it, ``Verify.speculate`` streams its steps); no loop runs here. Only token ids and a *reference* to the prefill's
KV pass through here; the KV bytes go from the prefill replica to the verifier through the Ray object store.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import gc
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import ray
from grpc_health.v1 import health_pb2
from ray import exceptions as ray_exceptions
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator

from deployments import api, auth
from deployments.config import INGRESS, AppConfig
from deployments.metrics import RequestMetrics
from deployments.openai_api import OpenAIRoutes, http_app
from deployments.placement import pin_cpus, unplaceable
from deployments.routing import pin
from deployments.stages import KVHandoff, SessionOpened, model_dirs, rss_bytes
from deployments.verify import DraftFallback, DraftResumed, Speculation
from deployments.status import (
    RequestDeadlineError, StageUnavailableError, UnauthenticatedError, replica_lost, to_status, unwrap,
)
from services import drafters, eagle_draft
from services.drafters import EAGLE_DRAFTER, MODEL_DRAFTER
from services.loading import check_tokenizers, describe
from services.loop import StepOutput
from services.sampling import reseeded
from services.text import TextStream
from splitspec.api.v1 import splitspec_pb2 as pb

logger = logging.getLogger(__name__)

PLACEMENT_CHECK_PERIOD_S = 2.0  # how often the ingress re-checks that every stage can be placed
HEALTH_PROBE_TIMEOUT_S = 2.0  # a stage replica that does not answer a ping this fast counts as down for Check
RECENT_HANDOFFS = 64  # KV handoffs remembered for `recent_handoffs` (placement checks, debugging)
MAX_RECOVERIES = 3  # replicas one request may lose and recover from; one more fails it with UNAVAILABLE
RETRY_BACKOFF_S = (0.1, 2.0)  # first and longest wait between calls to a stage that has just lost a replica


@dataclass
class _Sessions:
    """One request's verify session as the ingress holds it; replaced when its replica is lost."""

    verify_sid: str  # the session's id; a reopened session gets a new one (the old may linger on a live replica)
    verify: DeploymentHandle | None = None  # pinned to the replica that holds the session
    stream: DeploymentResponseGenerator | None = None  # Verify.speculate: the loop's steps
    skip_first: bool = False  # a recovered stream: its first token was emitted before the loss
    tokens: list[int] = field(default_factory=list)  # every token emitted so far: the context after the prompt
    recoveries: int = 0
    # calls opening a session whose answer the request has not taken yet: each is closed once it answers if the
    # request ends first (SpecDecodeIngress._opening)
    openings: dict[asyncio.Task, str] = field(default_factory=dict)  # call -> session id


class _Opening:
    """Awaitable answer of a call opening a session (``SpecDecodeIngress._opening``): awaiting it to its end hands
    the session to the request (the caller pins the stage to its replica at once, without awaiting anything in
    between, and closes it when the request ends); it may be awaited again, and a cancelled await leaves the call
    running."""

    def __init__(self, call: asyncio.Task, openings: dict):
        self.call, self.openings = call, openings

    def __await__(self):
        opened = yield from asyncio.shield(self.call).__await__()
        self.openings.pop(self.call, None)
        return opened


@serve.deployment(name="SpecDecodeIngress")
@serve.ingress(http_app)  # the OpenAI-compatible HTTP API (deployments.openai_api) beside the gRPC methods
class SpecDecodeIngress(OpenAIRoutes):
    def __init__(self, config: dict, prefill: DeploymentHandle, verify: DeploymentHandle):
        self.config = AppConfig.model_validate(config)
        pin_cpus(self.config.ingress_placement.cpus, INGRESS)
        self.prefill, self.verify = prefill, verify
        target_dir, draft_dir = model_dirs(self.config)
        self.target = describe(target_dir)
        self.model_id = self.config.models.served_name or target_dir.name  # the OpenAI API's model
        self.created = int(time.time())
        check_tokenizers(self.target, draft_dir)
        has_head = eagle_draft.find(draft_dir) is not None  # the drafter loads it (and checks it fits the target)
        self.drafters = tuple(name for name, kind in drafters.kinds().items() if kind.needs != "head" or has_head)
        self.default_drafter = self.config.speculation.drafter or (EAGLE_DRAFTER if has_head else MODEL_DRAFTER)
        if self.default_drafter not in self.drafters:
            raise ValueError(f"speculation.drafter is {EAGLE_DRAFTER!r} but {draft_dir} has no {eagle_draft.HEAD_FILE} "
                             "(`splitspec models prepare` installs the default pair's)")
        self.unplaceable: dict[str, str] = {}
        self.handoffs: deque[dict] = deque(maxlen=RECENT_HANDOFFS)
        self.metrics = RequestMetrics()
        # tokenising runs off the event loop, on one thread (a fast tokenizer is not safe for concurrent encodes)
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitspec-tokenize")
        self.active = 0  # requests between prefill and their last step on this replica (the adaptive policy's load)
        self.recoveries: dict[str, int] = defaultdict(int)  # lost stage replicas recovered from, by stage
        self._detached_tasks: set[asyncio.Task] = set()  # closes that outlive their requests (``_detached``)
        self._check_placement()
        self._watchdog = asyncio.get_event_loop().create_task(self._watch_placement())

    # -- gRPC methods (names match the service's RPCs) ---------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:
        timer = api.Timer()
        deadline = time.monotonic() + self.config.limits.request_timeout_s
        try:
            self._authenticate(grpc_context.invocation_metadata())
            plan = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._plan, request)
            text, token_ids, finish_reason = await self._collect(plan, timer, deadline)
        except asyncio.CancelledError:
            self.metrics.finished("Generate", grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            self._fail("Generate", grpc_context, exc)
        self.metrics.finished("Generate", "ok", timer.seconds())
        return pb.GenerateResponse(
            request_id=plan.request_id,
            text=text,
            token_ids=token_ids,
            finish_reason=api.FINISH_REASONS[finish_reason],
            usage=api.usage(plan, len(token_ids)),
            speculation_stats=api.speculation_stats(plan),
            timings=timer.timings(),
        )

    async def GenerateStream(self, request: pb.GenerateStreamRequest, grpc_context) -> AsyncIterator[pb.GenerateStreamResponse]:
        timer = api.Timer()
        deadline = time.monotonic() + self.config.limits.request_timeout_s
        try:
            self._authenticate(grpc_context.invocation_metadata())
            plan = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._plan, request)
            completion = 0
            async for step, token_ids, text in self._text_steps_before(deadline, plan, timer):
                completion += len(token_ids)
                chunk = pb.GenerateStreamResponse(
                    request_id=plan.request_id,
                    text=text,
                    token_ids=token_ids,
                    accepted_tokens=step.n_matches,
                    drafted_tokens=step.n_drafted,
                )
                if step.finish_reason:
                    chunk.finish_reason = api.FINISH_REASONS[step.finish_reason]
                    chunk.usage.CopyFrom(api.usage(plan, completion))
                    chunk.speculation_stats.CopyFrom(api.speculation_stats(plan))
                    chunk.timings.CopyFrom(timer.timings())
                    self.metrics.finished("GenerateStream", "ok", timer.seconds())
                yield chunk
        except asyncio.CancelledError:
            self.metrics.finished("GenerateStream", grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as exc:  # noqa: BLE001
            self._fail("GenerateStream", grpc_context, exc)

    def _text_steps_before(self, deadline: float, plan: api.Plan, timer: api.Timer) -> AsyncIterator:
        """``_text_steps`` until ``deadline`` (time.monotonic()), also while a step is awaited: then the request's
        sessions are closed and RequestDeadlineError is raised."""
        return _before(deadline, self._text_steps(plan, timer), lambda: RequestDeadlineError(
            f"the request ran past limits.request_timeout_s ({self.config.limits.request_timeout_s:g}s)"))

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1.Health/Check (Kubernetes' gRPC probe; no token needed): SERVING when the prefill and verify
        stages can be placed and each has a replica that answers; the draft stage is not needed (without it requests
        go on without speculation). ``service`` "" or "splitspec.v1.SpecDecode"."""
        if request.service not in ("", pb.DESCRIPTOR.services_by_name["SpecDecode"].full_name):
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            raise LookupError(request.service)
        up = await self._serving()
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def _serving(self) -> bool:
        """The prefill and verify stages can be placed and each has a replica that answers (Check, /health)."""
        essential = [stage for stage in self.unplaceable if stage != "draft"]
        return not essential and all(await asyncio.gather(self._answers(self.prefill), self._answers(self.verify)))

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context):
        grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        grpc_context.set_details("Watch is not served: poll Check")
        raise NotImplementedError("grpc.health.v1.Health/Watch")
        yield  # (a server stream)

    @staticmethod
    async def _answers(stage: DeploymentHandle) -> bool:
        try:
            await asyncio.wait_for(_awaited(stage.ping.remote()), timeout=HEALTH_PROBE_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001 - no replica, or none answering: not serving
            return False

    # -- the loop ---------------------------------------------------------------------------------

    def _authenticate(self, metadata) -> None:
        """With auth.token_sha256 set, the call's metadata (gRPC) or headers (HTTP) must carry its bearer token
        (compared in constant time)."""
        expected = self.config.auth.token_sha256
        if expected and not auth.authenticated(metadata, expected):
            raise UnauthenticatedError("unauthenticated")

    def _plan(self, request) -> api.Plan:
        essential = [why for stage, why in self.unplaceable.items() if stage != "draft"]  # without a drafter: no speculation
        if essential:
            raise StageUnavailableError("; ".join(essential))
        return api.parse(request, self.config, self.target.tokenizer,
                         max_context=self.config.context_limit(self.target.max_context),  # kv_capacity bounds it too
                         vocab_size=self.target.vocab_size, drafters=self.drafters, default_drafter=self.default_drafter)

    async def _collect(self, plan: api.Plan, timer: api.Timer, deadline: float) -> tuple[str, list[int], str]:
        text, token_ids, finish_reason = "", [], ""
        async for step, ids, delta in self._text_steps_before(deadline, plan, timer):
            text, token_ids, finish_reason = text + delta, token_ids + ids, step.finish_reason or finish_reason
        return text, token_ids, finish_reason

    async def _text_steps(self, plan: api.Plan, timer: api.Timer) -> AsyncIterator[tuple[StepOutput, list[int], str]]:
        """Each step's kept tokens and new text, cut at the first stop sequence (shared by both RPCs)."""
        stream = TextStream(self.target.tokenizer, plan.stop)
        steps = self._speculative_decode(plan, timer)
        self.metrics.started(len(plan.prompt_ids))
        try:
            async for i, step in _enumerate(steps):
                ids, text = stream.push(step.token_ids)
                if stream.stopped:
                    step.finish_reason = api.FINISH_STOP_SEQUENCE
                if step.finish_reason:
                    text += stream.flush()
                    self.metrics.pre_drafts(plan.stats.pre_drafts, plan.stats.pre_draft_hits)
                now = time.perf_counter()
                if i == 0:  # prefill's token
                    self.metrics.first_chunk(now - timer.start, len(ids))
                else:
                    self.metrics.verify_step(sent=len(ids), since_last_s=now - timer.last_emit, drafted=step.n_drafted,
                                             accepted=step.accepted, n_matches=step.n_matches)
                timer.last_emit = now
                yield step, ids, text
                if step.finish_reason:
                    return
        finally:
            await steps.aclose()  # closes the draft and verify sessions

    async def _speculative_decode(self, plan: api.Plan, timer: api.Timer) -> AsyncIterator[StepOutput]:
        """Prefill, then the request's loop in a verify replica: ``Verify.open`` (by reference: the KV handoff)
        opens its session and starts the loop there, ``Verify.speculate`` (by value) streams its steps; here each
        step is only passed on. A lost prefill or verify replica (or a KV lost with its prefill replica) is
        recovered from without the client noticing: the prompt and every emitted token but the last are prefilled
        again and a fresh loop goes on from that last token (``_recover``)."""
        s = _Sessions(verify_sid=plan.session_id)
        spec = Speculation(plan.max_new_tokens, sorted(self.target.eos_token_ids), plan.prompt_ids,
                           drafter=plan.drafter if plan.speculate else "", num_draft_tokens=plan.num_draft_tokens,
                           adaptive=plan.adaptive, overlap=plan.overlap)
        if spec.drafter and "draft" in self.unplaceable:  # (remote drafting, and no node for the draft stage)
            self._fell_back(plan, "start", self.unplaceable["draft"], StageUnavailableError.__name__)
            spec.drafter = ""
        features = drafters.reads_features(spec.drafter)  # the drafter reads the target's features: prefill them
        params = plan.params
        self.active += 1
        try:
            # (a prompt the prefill's prefix cache holds all but a few positions of leaves them to the verify replica,
            # whose batched pass computes them for little, where a prefill pass reads every weight: limits.local_prefill_tokens)
            local = 0 if features else self.config.limits.local_prefill_tokens
            handoff = await self._retrying(plan, "prefill", lambda: self.prefill.prefill.remote(
                plan.prompt_ids, params, features, local))
            timer.prefill_ms = timer.ms()
            self.metrics.prefilled("verify" if handoff.prompt_rest else "prefill")
            while True:
                try:
                    if s.stream is None:
                        opened = await self._retrying(plan, "verify", lambda: self._opening(
                            s, s.verify_sid, lambda: self.verify.open.remote(s.verify_sid, handoff, params, spec)))
                        s.verify = self.verify.options(session_id=pin(opened.replica_id))
                        self._handed_off(handoff, opened, timer)
                        handoff = None  # the last reference here: the object store frees the KV once the verifier holds it
                        if not s.recoveries:
                            self._decided(plan, opened)
                        s.stream = s.verify.options(stream=True, _by_reference=False).speculate.remote(s.verify_sid)
                    item = await self._call("verify", anext(s.stream))
                except StopAsyncIteration:
                    return
                except Exception as exc:  # noqa: BLE001 - a lost replica (or KV) is recovered from; anything else is raised
                    self._stop_stream(s)
                    lost_kv = isinstance(unwrap(exc), ray_exceptions.ObjectLostError)
                    if not (replica_lost(exc) or lost_kv):
                        raise
                    self._lost(plan, "prefill" if lost_kv else "verify", exc, s)
                    handoff, params, spec = await self._recover(plan, s, spec, features)
                    continue
                if isinstance(item, DraftFallback):
                    self._fell_back(plan, item.when, f"{item.error} (in the verify replica)", item.error)
                elif isinstance(item, DraftResumed):
                    logger.info("request %s: speculation resumed on a draft replica after %d tokens", plan.request_id,
                                len(s.tokens))
                    self.metrics.recovery("draft")
                    self.recoveries["draft"] += 1
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
            self._stop_stream(s)  # (its end closes the session on the replica)
            if s.verify is not None:  # (a session whose stream never started)
                self._detached(s.verify.close.remote, s.verify_sid)
            for call, opening_sid in s.openings.items():  # sessions whose replica the request never learnt
                self._close_when_opened(opening_sid, call)

    async def _recover(self, plan: api.Plan, s: _Sessions, spec: Speculation, features: bool):
        """After a lost verify replica: prefill the prompt and every emitted token but the last on a live prefill
        replica, for a fresh session pending that last token, the state it had before the loss. Before the first
        token: the prompt alone, in full, its first token drawn with the request's seed as if nothing had been
        lost. Returns the handoff, the sampling parameters and the loop's Speculation for the fresh session."""
        s.verify_sid = f"{plan.session_id}#{s.recoveries}"
        ids, params = plan.prompt_ids, plan.params
        if s.tokens:
            ids, params = plan.prompt_ids + s.tokens[:-1], reseeded(plan.params, len(s.tokens))
            spec = dataclasses.replace(spec, max_new_tokens=plan.max_new_tokens - (len(s.tokens) - 1), prompt_ids=ids)
        handoff = await self._retrying(plan, "prefill", lambda: self.prefill.prefill.remote(ids, params, features))
        if s.tokens:
            handoff = dataclasses.replace(handoff, first_token=s.tokens[-1])  # (prefill's own is not used)
            s.skip_first = True
        return handoff, params, spec

    def _decided(self, plan: api.Plan, opened: SessionOpened) -> None:
        """What the verify replica decided for the request: declined by the gate, pre-drafting or not."""
        plan.overlap = opened.overlap
        if opened.declined:
            plan.declined = True
            self.metrics.declined(opened.declined)

    def _handed_off(self, handoff: KVHandoff, opened: SessionOpened, timer: api.Timer) -> None:
        """Record a KV handoff prefill -> verify: its latency and bytes (metrics, timings, ``recent_handoffs``)."""
        timer.kv_handoff_ms = opened.handoff_ms
        self.metrics.kv_handoff(opened.resolved_bytes, opened.handoff_ms / 1000)
        self.handoffs.append({
            "kv_bytes": handoff.kv_bytes,
            "prefill_node": handoff.prefill_node,
            "verify_node": opened.node_id,
            "resolved_bytes": opened.resolved_bytes,
            "handoff_ms": opened.handoff_ms,
        })

    @staticmethod
    def _stop_stream(s: _Sessions) -> None:
        if s.stream is not None:
            s.stream.cancel()
            s.stream = None

    # -- recovery from lost replicas ------------------------------------------------------------

    async def _retrying(self, plan: api.Plan, stage: str, make_call: Callable, first=None):
        """The result of a stage call (``first``, else ``make_call()``); while its replica is lost, call again (Serve
        routes the call to a live replica or waits for the replacement) until ``stage_timeout_s`` after the loss."""
        delay, give_up = RETRY_BACKOFF_S[0], None
        while True:
            try:
                return await self._call(stage, first if first is not None else make_call())
            except Exception as exc:  # noqa: BLE001 - only a lost replica is retried
                first = None
                if not replica_lost(exc):
                    raise
                if give_up is None:
                    self._lost(plan, stage, exc)
                    give_up = time.monotonic() + self.config.limits.stage_timeout_s
                if time.monotonic() > give_up:
                    raise StageUnavailableError(f"stage {stage!r} lost its replica and no other answered within "
                                                f"{self.config.limits.stage_timeout_s:g}s") from exc
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_BACKOFF_S[1])

    def _lost(self, plan: api.Plan, stage: str, exc: BaseException, s: _Sessions | None = None) -> None:
        """Log a lost replica once and count the recovery; a request that has lost too many fails (UNAVAILABLE)."""
        if s is not None:
            s.recoveries += 1
            if s.recoveries > MAX_RECOVERIES:
                raise StageUnavailableError(f"the request lost more than {MAX_RECOVERIES} stage replicas; retry it") from exc
        logger.warning("request %s: %s replica lost (%s: %s); recovering", plan.request_id, stage,
                       type(unwrap(exc)).__name__, unwrap(exc))
        self.metrics.recovery(stage)
        self.recoveries[stage] += 1

    async def _call(self, stage: str, response):
        """Await a stage call (a response, or a stream's next item); a stage that does not answer in time is
        UNAVAILABLE, not a hang."""
        if stage in self.unplaceable:
            raise StageUnavailableError(self.unplaceable[stage])
        timeout = self.config.limits.stage_timeout_s
        start = time.perf_counter()
        try:
            result = await asyncio.wait_for(_awaited(response), timeout=timeout)
            self.metrics.stage_call(stage, time.perf_counter() - start)
            return result
        except asyncio.TimeoutError:
            if hasattr(response, "cancel"):  # a response (wait_for cancelled a stream's pending item itself)
                response.cancel()
            raise StageUnavailableError(f"stage {stage!r} did not answer within {timeout:g}s") from None

    def _fell_back(self, plan: api.Plan, when: str, cause, kind: str) -> None:
        logger.warning("request %s: draft stage failed at %s (%s); continuing without speculation", plan.request_id, when, cause)
        self.metrics.fallback(f"{when}: {kind}")
        plan.fallback = True

    def _opening(self, s: _Sessions, sid: str, make_call: Callable[[], DeploymentResponse]) -> _Opening:
        """The call ``make_call()`` opening verify session ``sid`` (``Verify.open``), made outside the request: Serve
        cancels a request's stage calls with it, and a cancel that meets the replica's answer leaves a session
        nobody closes (the replica had opened it, the answer is dropped; CI found sessions left so). Awaited to its
        end (``_Opening``) the session is the request's to close; if the request ends first, it is closed once the
        call answers (``_close_when_opened``, from ``s.openings``)."""
        response = contextvars.Context().run(make_call)  # no request context: not a child call of the request
        call = asyncio.get_running_loop().create_task(_awaited(response), context=contextvars.Context())
        s.openings[call] = sid
        return _Opening(call, s.openings)

    def _close_when_opened(self, sid: str, opening) -> None:
        """Close verify session ``sid`` once the call ``opening`` it has answered, wherever it opened: the request
        ended before it learnt the replica. (A cancelled open closes the session itself, on the replica:
        ``_Stage._open_session``.)"""
        async def close():
            try:
                opened = await opening
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the session never opened (or closed itself)
                return
            await self.verify.options(session_id=pin(opened.replica_id)).close.remote(sid)

        self._detached(close)

    def _detached(self, call: Callable, *args) -> None:
        """Run ``call(*args)`` (a stage call, or a coroutine function making them) to its end, outside the request:
        Serve cancels the stage calls a request makes once it is cancelled or has ended, and a session's close must
        outlive its request. Errors are logged, never raised."""
        async def run():
            try:
                await asyncio.wait_for(_awaited(call(*args)), timeout=self.config.limits.stage_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a replica gone or a session already closed: nothing to close
                logger.debug("detached call failed: %s", exc)

        task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())  # no request context
        self._detached_tasks.add(task)
        task.add_done_callback(self._detached_tasks.discard)

    def _fail(self, method: str, grpc_context, exc: Exception):
        code, message = to_status(exc)
        self.metrics.finished(method, code.name)
        grpc_context.set_code(code)
        grpc_context.set_details(message)
        raise exc  # Serve keeps a status set before raising (a plain return would report OK)

    # -- fail fast on stages that no node can host ---------------------------------------------

    def _check_placement(self) -> None:
        problems = unplaceable(self.config, ray.nodes())
        if problems != self.unplaceable:
            for stage, why in problems.items():
                effect = "requests run without speculation" if stage == "draft" else "requests get UNAVAILABLE"
                logger.error("%s; %s until such a node joins", why, effect)
            self.unplaceable = problems

    async def _watch_placement(self) -> None:
        while True:
            await asyncio.sleep(PLACEMENT_CHECK_PERIOD_S)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._check_placement)
            except Exception:  # noqa: BLE001 - keep watching
                logger.exception("placement check failed")

    async def policy_state(self) -> dict:
        """What the adaptive policy has learned, per drafter: step costs (ms) and acceptance, under "verify_replica"
        on one verify replica (where the loops run)."""
        try:
            return {"verify_replica": await self._call("verify", self.verify.policy_state.remote())}
        except Exception as exc:  # noqa: BLE001 - a report: say why it lacks the replica's part
            return {"verify_replica": {"error": str(unwrap(exc))}}

    async def stats(self) -> dict:
        """This replica: requests running, resident memory, the lost stage replicas it has recovered from, by
        stage, and the requests it has finished, by "<method> <outcome>" (as splitspec_requests_total counts them); the thread its
        methods run on (as the stages' ``loop_thread``)."""
        return {"replica_id": serve.get_replica_context().replica_id.unique_id, "active": self.active,
                "rss_bytes": rss_bytes(), "recoveries": dict(self.recoveries), "requests": dict(self.metrics.outcomes),
                "loop_thread": threading.current_thread().name}

    async def collect_garbage(self) -> int:
        """Run Python's cycle collector now (see Stage.collect_garbage); returns what it found."""
        return gc.collect()

    async def recent_handoffs(self) -> list[dict]:
        """Where the last KV handoffs went: prefill node, verify node, bytes resolved, latency."""
        return list(self.handoffs)


async def _awaited(response):
    return await response


async def _before(deadline: float, items: AsyncIterator, error: Callable[[], Exception]) -> AsyncIterator:
    """The items that come before ``deadline`` (time.monotonic()); then ``error()`` is raised, also while an item is
    awaited (``items`` is then closed: its cleanup runs)."""
    try:
        while True:
            timeout = asyncio.timeout(max(0.0, deadline - time.monotonic()))  # (no task per item)
            try:
                async with timeout:
                    item = await anext(items)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if timeout.expired():
                    raise error() from None
                raise
            if time.monotonic() > deadline:  # (an item that came without waiting, past the deadline)
                raise error()
            yield item
    finally:
        await items.aclose()


async def _enumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1
