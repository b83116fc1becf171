"""The ingress: gRPC methods of splitspec.v1.SpecDecode, running the speculative loop over the stage handles.

Only token ids, draft distributions and a *reference* to the prefill's KV pass
through here; the KV bytes go from the prefill replica to the verifier through
the Ray object store.
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
from deployments.stages import DraftFallback, KVHandoff, SessionOpened, Speculation, model_dirs, rss_bytes
from deployments.status import DRAFT_FAILURES, RequestDeadlineError, StageUnavailableError, UnauthenticatedError, to_status, unwrap
from services import eagle_draft
from services.draft import DRAFTERS, EAGLE_DRAFTER, FEATURE_DRAFTERS, MODEL_DRAFTER
from services.errors import SessionEvictedError, SessionNotFoundError
from services.loading import check_tokenizers, describe
from services.loop import PRE_DRAFT_GUESSES, Calls, Propose, Results, SpeculativeLoop, StepOutput, Verify, execute_async
from services import policy as spec_policy
from services.policy import AcceptanceCounts, AdaptiveK, CostModel, RequestGate
from services.sampling import reseeded
from services.text import TextStream
from splitspec.v1 import splitspec_pb2 as pb

logger = logging.getLogger(__name__)

PLACEMENT_CHECK_PERIOD_S = 2.0  # how often the ingress re-checks that every stage can be placed
HEALTH_PROBE_TIMEOUT_S = 2.0  # a stage replica that does not answer a ping this fast counts as down for Check
RECENT_HANDOFFS = 64  # KV handoffs remembered for `recent_handoffs` (placement checks, debugging)
# A stage replica that is gone (killed, OOM, node lost) or that lost the session (restarted): the ingress recovers
# (``_replica_lost``; a session evicted by a full replica is not one: recovering would evict another).
REPLICA_LOST = (SessionNotFoundError, ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)
MAX_RECOVERIES = 3  # replicas one request may lose and recover from; one more fails it with UNAVAILABLE
RETRY_BACKOFF_S = (0.1, 2.0)  # first and longest wait between calls to a stage that has just lost a replica


@dataclass
class _Sessions:
    """One request's draft and verify sessions as the ingress holds them; replaced when their replica is lost."""

    features: bool  # the drafter reads the target's features: the verify session's verdicts carry them
    verify_sid: str  # the sessions' ids; a reopened session gets a new one (the old may linger on a live replica)
    draft_sid: str
    draft: DeploymentHandle | None = None  # pinned to the replica that holds the draft session
    verify: DeploymentHandle | None = None  # pinned to the replica that holds the verify session
    tokens: list[int] = field(default_factory=list)  # every token emitted so far: the context after the prompt
    recoveries: int = 0
    draft_back: asyncio.Task | None = None  # after the draft stage was lost: resolves True once a draft replica answers
    decoding: DeploymentResponseGenerator | None = None  # without a drafter: the streamed call (``_decoded``)
    decoded_at: float | None = None  # time.perf_counter() when its last verdict came
    # calls opening a session (verify open, draft start) whose answer the request has not taken yet: each is closed
    # once it answers if the request ends first (SpecDecodeIngress._opening)
    openings: dict[asyncio.Task, tuple[str, str]] = field(default_factory=dict)  # call -> (stage, session id)


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
    def __init__(self, config: dict, prefill: DeploymentHandle, draft: DeploymentHandle, verify: DeploymentHandle):
        self.config = AppConfig.model_validate(config)
        pin_cpus(self.config.ingress_placement.cpus, INGRESS)
        self.prefill, self.draft, self.verify = prefill, draft, verify
        target_dir, draft_dir = model_dirs(self.config)
        self.target = describe(target_dir)
        self.model_id = self.config.models.served_name or target_dir.name  # the OpenAI API's model
        self.created = int(time.time())
        check_tokenizers(self.target, draft_dir)
        has_head = eagle_draft.find(draft_dir) is not None  # the draft stage loads it (and checks it fits the target)
        self.drafters = tuple(d for d in DRAFTERS if d != EAGLE_DRAFTER or has_head)
        self.default_drafter = self.config.speculation.drafter or (EAGLE_DRAFTER if has_head else MODEL_DRAFTER)
        if self.default_drafter not in self.drafters:
            raise ValueError(f"speculation.drafter is {EAGLE_DRAFTER!r} but {draft_dir} has no {eagle_draft.HEAD_FILE} "
                             "(`splitspec models prepare` installs the default pair's)")
        self.unplaceable: dict[str, str] = {}
        self.handoffs: deque[dict] = deque(maxlen=RECENT_HANDOFFS)
        self.metrics = RequestMetrics()
        # tokenising runs off the event loop, on one thread (a fast tokenizer is not safe for concurrent encodes)
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitspec-tokenize")
        # what the adaptive policy learns, per ingress replica: stage-call costs and each drafter's acceptance
        self.costs = defaultdict(CostModel)
        self.acceptance = defaultdict(AcceptanceCounts)
        self.gates = defaultdict(lambda: RequestGate(self.config.speculation.explore_every))  # per drafter
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
        """prefill, then services.loop's SpeculativeLoop over the draft and verify handles, one StepOutput per step.

        A lost prefill or verify replica is recovered from without the client noticing (``_reopen_verify``); a lost
        draft replica turns speculation off until a draft replica answers again (``_restart_draft``).
        """
        sid, params = plan.session_id, plan.params
        started = None
        s = _Sessions(features=plan.drafting and plan.drafter in FEATURE_DRAFTERS, verify_sid=sid, draft_sid=sid)
        self.active += 1
        try:
            if plan.speculate and plan.adaptive and not plan.overlap:  # where speculation does not pay: no drafter
                why = self.gates[plan.drafter].decline(self._policy(plan))
                if why:
                    plan.declined = True
                    self.metrics.declined(why)
            # 1. prefill the target and, in parallel, start the draft session over the same prompt
            #    (a feature drafter starts once prefill has its prompt features; they go by reference)
            features = s.features = plan.drafting and plan.drafter in FEATURE_DRAFTERS
            # speculation.colocate_drafter: the verify replica drafts itself (no draft stage call)
            colocated = plan.drafting and self.config.speculation.colocate_drafter and not plan.overlap
            if plan.drafting and not colocated and "draft" in self.unplaceable:
                self._fall_back(plan, StageUnavailableError(self.unplaceable["draft"]), "start")
            elif plan.drafting and not colocated and not features:
                started = self._opening(s, "draft", sid, lambda: self.draft.start.remote(sid, plan.prompt_ids, params, plan.drafter))
            # (a prompt the prefill's prefix cache holds all but a few positions of leaves them to the verify replica,
            # whose batched pass computes them for little, where a prefill pass reads every weight: limits.local_prefill_tokens)
            local = 0 if features else self.config.limits.local_prefill_tokens
            handoff = await self._retrying(plan, "prefill", lambda: self.prefill.prefill.remote(
                plan.prompt_ids, params, features, local))
            timer.prefill_ms = timer.ms()
            self.metrics.prefilled("verify" if handoff.prompt_rest else "prefill")
            if features and not colocated and not plan.fallback:
                started = self._opening(s, "draft", sid, lambda: self.draft.start.remote(
                    sid, plan.prompt_ids, params, plan.drafter, handoff))
            draft_replica = ""
            if self.config.speculation.verify_driven and started is not None and not plan.overlap:
                try:
                    draft_replica = (await self._call("draft", started)).replica_id
                    s.draft = self.draft.options(session_id=pin(draft_replica))
                except Exception as exc:  # noqa: BLE001 - go on with the target alone, on the path below
                    self._draft_lost(plan, s, exc, "start")
                started = None
            if colocated or draft_replica:  # the loop runs in the verify replica (Verify.speculate)
                steps = self._speculate_in_verify(plan, s, handoff, draft_replica, timer)
                del handoff  # (the stream's call holds the KV reference until the verifier has resolved it)
                async for step in steps:
                    yield step
                return
            # 2. hand the verifier the KV *reference*; it resolves the bytes from the object store (while the draft starts)
            spec = self.config.speculation
            first_token = handoff.first_token  # None: the verify session's first step draws it (handoff.prompt_rest)
            decodes = (spec.stream_off and not plan.drafting
                       and (first_token is None or plan.max_new_tokens > 1 and first_token not in self.target.eos_token_ids))
            decode_tokens = plan.max_new_tokens - (first_token is not None)  # the verify replica's steps

            def open_again():
                self._stop_decoding(s)  # (a stream that failed to open goes with its failure)
                decode = (decode_tokens, sorted(self.target.eos_token_ids)) if decodes else None
                return self._opening(s, "verify", sid, lambda: self.verify.open.remote(
                    sid, handoff, params, features, decode=decode))
            if decodes and not spec.stream_by_value:
                # without a drafter, the same call opens the session and decodes (Verify.decode): the first step
                # follows the open on the replica, while the first token goes out
                opening = anext(self._start_decoding(plan, s, decode_tokens, opening=(handoff, params)))
            else:
                # (stream_by_value: the open, by reference, starts the steps on the replica; the stream, by value,
                # takes their verdicts from the loop's first step on)
                opening = open_again()  # (no stream yet to stop)
            if started is not None:
                try:
                    s.draft = self.draft.options(session_id=pin((await self._call("draft", started)).replica_id))
                except Exception as exc:  # noqa: BLE001 - go on with the target alone
                    self._draft_lost(plan, s, exc, "start")
                started = None
            try:
                opened = await self._retrying(plan, "verify", open_again, first=opening)
            except Exception as exc:  # noqa: BLE001 - the KV went with its prefill replica: prefill again
                self._stop_decoding(s)
                if not isinstance(unwrap(exc), ray_exceptions.ObjectLostError):
                    raise
                self._lost(plan, "prefill", exc, s)
                opened, first_token = await self._open_verify(plan, s, plan.prompt_ids, first_token, params)
            s.verify = self.verify.options(session_id=pin(opened.replica_id))
            self._handed_off(handoff, opened, timer)
            del handoff  # the last reference here: the object store frees the KV once the verifier holds it
            if first_token is None:
                first_token = await self._first_step(plan, s, decodes)
            timer.ttft_ms = timer.ms()
            policy = self._policy(plan) if plan.adaptive and plan.drafting else None
            loop = SpeculativeLoop(first_token, max_new_tokens=plan.max_new_tokens, eos=self.target.eos_token_ids,
                                   num_draft_tokens=plan.num_draft_tokens, drafting=s.draft is not None and not plan.fallback,
                                   policy=policy, overlap=plan.overlap, guesses=PRE_DRAFT_GUESSES[plan.drafter],
                                   stats=plan.stats, tree_width=self._tree_width(plan))
            results = None
            while (item := loop.advance(results)) is not None:
                if isinstance(item, StepOutput):
                    s.tokens += item.token_ids
                    yield item
                    results = None
                    if s.draft_back is not None and s.draft_back.done():  # a draft replica is back: draft again
                        await self._restart_draft(plan, s, loop)
                else:  # 3.-5. draft, verify, accept (concurrently when pre-drafting)
                    results = await self._execute(item, plan, s)
        finally:
            self.active -= 1
            self._stop_decoding(s)
            # close both sessions without waiting (also when the client went away or the deadline passed)
            if s.verify is not None:
                self._detached(s.verify.close.remote, s.verify_sid)
            if s.draft is not None:
                self._detached(s.draft.close.remote, s.draft_sid)
            for call, (stage, opening_sid) in s.openings.items():  # sessions whose replica the request never learnt
                self._close_when_opened(self.draft if stage == "draft" else self.verify, opening_sid, call)
            if s.draft_back is not None:
                s.draft_back.cancel()

    async def _speculate_in_verify(self, plan: api.Plan, s: _Sessions, handoff: KVHandoff, draft_replica: str,
                                   timer: api.Timer) -> AsyncIterator[StepOutput]:
        """The request's loop runs in a verify replica (Verify.speculate), drafting there (speculation.colocate_drafter)
        or asking the draft replica ``draft_replica`` directly (speculation.verify_driven); here each step is only
        passed on. A lost verify replica (or a KV lost with its prefill replica) is recovered from: the prompt and
        every emitted token but the last are prefilled again and a fresh stream goes on from that last token (with a
        remote drafter, without speculation: its session followed the lost loop). The caller closes the sessions."""
        spec = Speculation(plan.max_new_tokens, sorted(self.target.eos_token_ids), plan.num_draft_tokens, plan.adaptive,
                           plan.drafter, plan.prompt_ids, draft_replica=draft_replica, draft_sid=s.draft_sid,
                           tree_width=self._tree_width(plan))
        params = plan.params
        while True:
            try:
                if s.decoding is None:
                    s.decoding = self.verify.options(stream=True).speculate.remote(
                        s.verify_sid, (handoff, params, spec.drafting and s.features), spec)
                    opened = await self._call("verify", anext(s.decoding))
                    s.verify = self.verify.options(session_id=pin(opened.replica_id))
                    self._handed_off(handoff, opened, timer)
                    handoff = None  # the last reference here: the object store frees the KV once the verifier holds it
                    if s.tokens:  # a recovered stream: its first token was emitted before the loss
                        await self._call("verify", anext(s.decoding))
                item = await self._call("verify", anext(s.decoding))
            except StopAsyncIteration:
                return
            except Exception as exc:  # noqa: BLE001 - a lost replica (or KV) is recovered from; anything else is raised
                self._stop_decoding(s)
                lost_kv = isinstance(unwrap(exc), ray_exceptions.ObjectLostError)
                if not (_replica_lost(exc) or lost_kv):
                    raise
                self._lost(plan, "prefill" if lost_kv else "verify", exc, s)
                s.verify_sid = f"{plan.session_id}#{s.recoveries}"
                ids, params = plan.prompt_ids + s.tokens[:-1], reseeded(plan.params, len(s.tokens))
                spec = dataclasses.replace(spec, max_new_tokens=plan.max_new_tokens - max(len(s.tokens) - 1, 0),
                                           prompt_ids=ids, drafting=spec.drafting and not spec.draft_replica)
                handoff = await self._retrying(plan, "prefill", lambda: self.prefill.prefill.remote(
                    ids, params, spec.drafting and s.features))
                if s.tokens:
                    handoff = dataclasses.replace(handoff, first_token=s.tokens[-1])  # (prefill's own is not used)
                continue
            if isinstance(item, DraftFallback):
                self._fell_back(plan, item.when, f"{item.error} (in the verify replica)", item.error)
                continue
            if s.tokens:  # (prefill's token is no verify step)
                plan.stats.add(item)
            else:
                timer.ttft_ms = timer.ms()
            s.tokens += item.token_ids
            yield item

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

    def _policy(self, plan: api.Plan) -> AdaptiveK:
        """A request's adaptive k, on this replica's measured costs and its drafter's acceptance so far."""
        return AdaptiveK(self.costs[plan.drafter], self.acceptance[plan.drafter], k_max=plan.num_draft_tokens,
                         load=lambda: self.active, max_load=self.config.speculation.off_above_concurrency,
                         width=self._tree_width(plan))

    def _tree_width(self, plan: api.Plan) -> int:
        """Draft trees (speculation.tree_width) for a greedy request that does not pre-draft; chains otherwise."""
        return self.config.speculation.tree_width if plan.params.greedy and not plan.overlap else 1

    async def _execute(self, calls: Calls, plan: api.Plan, s: _Sessions) -> Results:
        """Run one round of the loop's stage calls (both at once when it pre-drafts) and time each."""

        async def propose(p: Propose):
            try:
                return await self._call("draft", s.draft.propose.remote(s.draft_sid, p.k, p.accepts, p.forced, p.guesses,
                                                                        p.width))
            except Exception as exc:  # noqa: BLE001 - go on with the target alone
                self._draft_lost(plan, s, exc, "propose")
                return None

        async def verify(v: Verify):
            while True:
                try:
                    if self.config.speculation.stream_off and not plan.drafting:  # one streamed call
                        return await self._decoded(plan, s)
                    return await self._call("verify", s.verify.verify.remote(s.verify_sid, v.draft_ids, v.probs, v.parents))
                except Exception as exc:  # noqa: BLE001 - a lost replica is recovered from; anything else is raised
                    self._stop_decoding(s)
                    if not _replica_lost(exc):
                        raise
                    await self._reopen_verify(plan, s, exc)  # then verify the same block again

        return await execute_async(calls, propose, verify)

    async def _decoded(self, plan: api.Plan, s: _Sessions):
        """The next verdict of the request's decode stream (Verify.decode: speculation off as one streamed call),
        which is opened at the first step and again after a recovery, for the tokens still to come."""
        if s.decoding is None:
            self._start_decoding(plan, s, plan.max_new_tokens - len(s.tokens))
        try:
            verdict = await self._call("verify", anext(s.decoding))
        except StopAsyncIteration:  # (the loop asks for no step beyond max_new_tokens or an end-of-sequence token)
            raise RuntimeError("the verify stage's decode stream ended before the request") from None
        now = time.perf_counter()
        if s.decoded_at is not None:  # a token's time on this path, for RequestGate (not the stream's first)
            self.costs[plan.drafter].observe_off_step(now - s.decoded_at)
        s.decoded_at = now
        return verdict

    def _start_decoding(self, plan: api.Plan, s: _Sessions, max_tokens: int, opening=None) -> DeploymentResponseGenerator:
        """Open the request's decode stream on its verify replica (``opening``: on any replica, opening the session
        there first); the ingress cancels it when the request ends (``_stop_decoding``)."""
        handle = self.verify if opening is not None else s.verify
        # (by value only without an opening: its KV handoff is an object reference, which must go by reference)
        by_value = opening is None and self.config.speculation.stream_by_value
        s.decoding = handle.options(stream=True, _by_reference=not by_value).decode.remote(
            s.verify_sid, max_tokens, sorted(self.target.eos_token_ids), opening)
        return s.decoding

    @staticmethod
    def _stop_decoding(s: _Sessions) -> None:
        if s.decoding is not None:
            s.decoding.cancel()
            s.decoding, s.decoded_at = None, None

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
                if not _replica_lost(exc):
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

    async def _reopen_verify(self, plan: api.Plan, s: _Sessions, exc: BaseException) -> int:
        """The verify session's replica is gone: prefill the prompt and every emitted token but the last on a live
        prefill replica, and open the session again on a live verify replica, pending that last token — the state it
        had before the failed call. Before the first token (a local prefill's first step was lost): the prompt alone,
        in full, pending the prefill's own first token, drawn with the request's seed as if nothing had been lost.
        Returns the pending token."""
        self._lost(plan, "verify", exc, s)
        self._detached(s.verify.close.remote, s.verify_sid)  # (a replica that is alive after all frees its KV)
        s.verify_sid = f"{plan.session_id}#{s.recoveries}"
        if s.tokens:
            ids, pending, params = plan.prompt_ids + s.tokens[:-1], s.tokens[-1], reseeded(plan.params, len(s.tokens))
        else:
            ids, pending, params = plan.prompt_ids, None, plan.params
        opened, pending = await self._open_verify(plan, s, ids, pending, params)
        s.verify = self.verify.options(session_id=pin(opened.replica_id))
        return pending

    async def _first_step(self, plan: api.Plan, s: _Sessions, decodes: bool) -> int:
        """The first token of a session opened with the prompt's last positions (``KVHandoff.prompt_rest``): its first
        step computes them and draws it (the decode stream's first verdict, or a verify call without drafts). If the
        verify replica is lost meanwhile, the prompt is prefilled in full and the session opened again on live
        replicas, with the prefill's token (``_reopen_verify``)."""
        try:
            if decodes:
                verdict = await self._decoded(plan, s)
            else:
                verdict = await self._call("verify", s.verify.verify.remote(s.verify_sid, [], None, None))
            return verdict.token_ids[0]
        except Exception as exc:  # noqa: BLE001 - a lost replica is recovered from; anything else is raised
            self._stop_decoding(s)
            if not _replica_lost(exc):
                raise
            return await self._reopen_verify(plan, s, exc)

    async def _open_verify(self, plan: api.Plan, s: _Sessions, ids: list[int], pending: int | None,
                           params) -> tuple[SessionOpened, int]:
        """Open verify session ``s.verify_sid`` on a live replica from a prefill of ``ids`` (all of it: no positions
        left to the verifier), pending ``pending`` (None: the prefill's own first token, for a request that has not
        drawn it yet); returns the session and its pending token. A KV lost with its prefill replica (between
        prefill and open) is prefilled again."""
        while True:
            handoff = await self._retrying(plan, "prefill", lambda: self.prefill.prefill.remote(ids, params, False))
            if pending is not None:
                handoff = dataclasses.replace(handoff, first_token=pending)  # (prefill's own next token is not used)
            try:
                opened = await self._retrying(plan, "verify", lambda: self._opening(
                    s, "verify", s.verify_sid, lambda: self.verify.open.remote(s.verify_sid, handoff, params, s.features)))
                return opened, handoff.first_token
            except Exception as exc:  # noqa: BLE001
                if not isinstance(unwrap(exc), ray_exceptions.ObjectLostError):
                    raise
                self._lost(plan, "prefill", exc, s)

    def _draft_lost(self, plan: api.Plan, s: _Sessions, exc: BaseException, when: str) -> None:
        """Go on with the target alone after a draft-stage failure; if the replica was lost, watch for a live one."""
        self._fall_back(plan, exc, when)
        if _replica_lost(exc) and s.draft_back is None and s.recoveries < MAX_RECOVERIES:
            s.draft_back = asyncio.ensure_future(self._draft_replica_answers())

    async def _draft_replica_answers(self) -> bool:
        """True once a draft replica answers a call (within stage_timeout_s), False if none does."""
        delay, give_up = RETRY_BACKOFF_S[0], time.monotonic() + self.config.limits.stage_timeout_s
        while time.monotonic() < give_up:
            try:
                await self._call("draft", self.draft.stats.remote())
                self.recoveries["draft_replica_answered"] += 1
                return True
            except Exception:  # noqa: BLE001 - the lost replica, or none yet: ask again
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_BACKOFF_S[1])
        return False

    async def _restart_draft(self, plan: api.Plan, s: _Sessions, loop: SpeculativeLoop) -> None:
        """Open a fresh draft session over the prompt and every emitted token but the last, and draft again."""
        back, s.draft_back = s.draft_back.result(), None
        if not back:
            return
        ids = plan.prompt_ids + s.tokens[:-1]
        params = reseeded(plan.params, len(s.tokens))
        s.recoveries += 1  # (the loss was logged when the request fell back)
        if s.draft is not None:
            self._detached(s.draft.close.remote, s.draft_sid)
        s.draft_sid = f"{plan.session_id}#{s.recoveries}"
        self.metrics.recovery("draft")
        self.recoveries["draft"] += 1
        try:
            handoff = None
            if s.features:  # the drafter needs the target's features of all those tokens
                handoff = await self._retrying(plan, "prefill", lambda: self.prefill.prefill.remote(ids, params, True))
            opened = await self._call("draft", self._opening(
                s, "draft", s.draft_sid, lambda: self.draft.start.remote(s.draft_sid, ids, params, plan.drafter, handoff)))
        except Exception as exc:  # noqa: BLE001 - stay with the target alone
            if not isinstance(unwrap(exc), DRAFT_FAILURES + REPLICA_LOST):
                raise
            logger.warning("request %s: the draft stage is still failing (%s); going on without speculation",
                           plan.request_id, unwrap(exc))
            return
        s.draft = self.draft.options(session_id=pin(opened.replica_id))
        loop.resume_drafting()
        logger.info("request %s: speculation resumed on a draft replica after %d tokens", plan.request_id, len(s.tokens))

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

    def _fall_back(self, plan: api.Plan, exc: Exception, when: str) -> None:
        """Turn speculation off for this request after a draft-stage failure, or re-raise any other error."""
        cause = unwrap(exc)
        if not isinstance(cause, DRAFT_FAILURES):
            raise exc
        self._fell_back(plan, when, cause, type(cause).__name__)

    def _fell_back(self, plan: api.Plan, when: str, cause, kind: str) -> None:
        logger.warning("request %s: draft stage failed at %s (%s); continuing without speculation", plan.request_id, when, cause)
        self.metrics.fallback(f"{when}: {kind}")
        plan.fallback = True

    def _opening(self, s: _Sessions, stage: str, sid: str, make_call: Callable[[], DeploymentResponse]) -> _Opening:
        """The call ``make_call()`` opening session ``sid`` on ``stage`` (verify ``open``, draft ``start``), made outside
        the request: Serve cancels a request's stage calls with it, and a cancel that meets the replica's answer
        leaves a session nobody closes (the replica had opened it, the answer is dropped; CI found sessions left so).
        Awaited to its end (``_Opening``) the session is the request's to close; if the request ends first, it is
        closed once the call answers (``_close_when_opened``, from ``s.openings``)."""
        response = contextvars.Context().run(make_call)  # no request context: not a child call of the request
        call = asyncio.get_running_loop().create_task(_awaited(response), context=contextvars.Context())
        s.openings[call] = (stage, sid)
        return _Opening(call, s.openings)

    def _close_when_opened(self, stage: DeploymentHandle, sid: str, opening) -> None:
        """Close session ``sid`` once the call ``opening`` it has answered, wherever it opened: the request ended
        before it learnt the replica. (A streamed call that opens a session and is cancelled meanwhile — the decode
        and speculate streams — closes it itself, on the replica: ``_Stage._open_session``.)"""
        async def close():
            try:
                opened = await opening
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the session never opened (or closed itself)
                return
            await stage.options(session_id=pin(opened.replica_id)).close.remote(sid)

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
        """What the adaptive policy has learned, per drafter: step costs (ms) and acceptance — on this replica (the
        loops it drives, and its requests' decode streams), and under "verify_replica" on one verify replica (the
        loops that run there: speculation.colocate_drafter / verify_driven)."""
        state = {drafter: spec_policy.describe(costs, self.acceptance.get(drafter)) for drafter, costs in self.costs.items()}
        try:
            state["verify_replica"] = await self._call("verify", self.verify.policy_state.remote())
        except Exception as exc:  # noqa: BLE001 - a report: say why it lacks the replica's part
            state["verify_replica"] = {"error": str(unwrap(exc))}
        return state

    async def stats(self) -> dict:
        """This replica: requests running, resident memory, the lost stage replicas it has recovered from, by
        stage (``draft_replica_answered``: times a request that lost its draft replica found a live one), and the
        requests it has finished, by "<method> <outcome>" (as splitspec_requests_total counts them); the thread its
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


def _replica_lost(exc: BaseException) -> bool:
    """A stage call failed because its replica is gone or restarted (recoverable), not because it is full."""
    cause = unwrap(exc)
    return isinstance(cause, REPLICA_LOST) and not isinstance(cause, SessionEvictedError)


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
