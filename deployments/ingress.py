"""The ingress: the gRPC methods of splitspec.v1.SpecDecode and grpc.health.v1.Health, and the OpenAI-compatible
routes (deployments.openai_api): authentication, admission and parsing, then each request's sessions
(deployments.decoding: prefill, the KV handoff, the verify replica's loop streamed back) and their recovery from
lost replicas (deployments.recovery).

Its public interface (``authenticate``, ``plan``, ``text_steps``, ``collect``, ``serving``) is what the HTTP routes
drive, the same as the gRPC methods.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import ray
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import api, auth, calls, tools
from deployments.config import INGRESS, AppConfig
from deployments.decoding import Decoder
from deployments.metrics import RequestMetrics
from deployments.openai_api import OpenAIRoutes, http_app
from deployments.placement import pin_cpus, unplaceable
from deployments.recovery import StageCalls
from deployments.stages import model_dirs, rss_bytes
from deployments.status import RequestDeadlineError, StageUnavailableError, UnauthenticatedError, to_status, unwrap
from services import drafters, eagle_draft
from services.constraint import Grammars
from services.loading import check_tokenizers, describe
from services.loop import StepOutput
from services.text import TextStream
from splitspec.api.v1 import splitspec_pb2 as pb

logger = logging.getLogger(__name__)

PLACEMENT_CHECK_PERIOD_S = 2.0  # how often the ingress re-checks that every stage can be placed
HEALTH_PROBE_TIMEOUT_S = 2.0  # a stage replica that does not answer a ping this fast counts as down for Check


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
        self.max_context = self.target.max_context
        self.tokenizer = self.target.tokenizer
        if self.config.models.chat_template:
            self.tokenizer.chat_template = self.config.models.chat_template
        self.tool_format = tools.server_format(self.tokenizer.chat_template, self.config.models.tool_call_parser)
        # structured outputs' schemas are compiled here first, so that a bad one is refused before any stage works
        self.grammars = Grammars(self.tokenizer, vocab_size=self.target.vocab_size, eos_token_ids=self.target.eos_token_ids)
        check_tokenizers(self.target, draft_dir)
        has_head = eagle_draft.find(draft_dir) is not None  # the drafter loads it (and checks it fits the target)
        self.drafters = tuple(name for name, kind in drafters.kinds().items() if kind.needs != "head" or has_head)
        self.default_drafter = self.config.speculation.drafter or drafters.default_kind(self.drafters)
        if self.default_drafter not in self.drafters:
            raise ValueError(f"speculation.drafter is {self.default_drafter!r} but {draft_dir} has no "
                             f"{eagle_draft.HEAD_FILE} (`splitspec models prepare` installs the default pair's)")
        self.metrics = RequestMetrics()
        self.stages = StageCalls(self.config, self.metrics)
        self.decoder = Decoder(self.config, prefill, verify, self.target.eos_token_ids, self.metrics, self.stages)
        # tokenising runs off the event loop, on one thread (a fast tokenizer is not safe for concurrent encodes)
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitspec-tokenize")
        self._check_placement()
        self._watchdog = asyncio.get_event_loop().create_task(self._watch_placement())

    # -- gRPC methods (names match the service's RPCs) ---------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:
        timer = api.Timer()
        deadline = time.monotonic() + self.config.limits.request_timeout_s
        try:
            self.authenticate(grpc_context.invocation_metadata())
            plan = await self.plan(request)
            answer = await self.collect(plan, timer, deadline)
        except asyncio.CancelledError:
            self.metrics.finished("Generate", grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            self._fail("Generate", grpc_context, exc)
        self.metrics.finished("Generate", "ok", timer.seconds())
        return pb.GenerateResponse(
            request_id=plan.request_id,
            text=answer.text,
            token_ids=answer.token_ids,
            finish_reason=api.FINISH_REASONS[answer.finish_reason],
            usage=api.usage(plan, len(answer.token_ids)),
            speculation_stats=api.speculation_stats(plan),
            timings=timer.timings(),
            logprobs=api.logprobs(answer.logprobs),
        )

    async def GenerateStream(self, request: pb.GenerateStreamRequest, grpc_context) -> AsyncIterator[pb.GenerateStreamResponse]:
        timer = api.Timer()
        deadline = time.monotonic() + self.config.limits.request_timeout_s
        try:
            self.authenticate(grpc_context.invocation_metadata())
            plan = await self.plan(request)
            completion = 0
            async for step, token_ids, text in self.text_steps(plan, timer, deadline):
                completion += len(token_ids)
                chunk = pb.GenerateStreamResponse(
                    request_id=plan.request_id,
                    text=text,
                    token_ids=token_ids,
                    accepted_tokens=step.n_matches,
                    drafted_tokens=step.n_drafted,
                    logprobs=api.logprobs(step.logprobs),
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

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1.Health/Check (Kubernetes' gRPC probe; no token needed): SERVING when the prefill and verify
        stages can be placed and each has a replica that answers; the draft stage is not needed (without it requests
        go on without speculation). ``service`` "" or "splitspec.v1.SpecDecode"."""
        if request.service not in ("", pb.DESCRIPTOR.services_by_name["SpecDecode"].full_name):
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            raise LookupError(request.service)
        up = await self.serving()
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context):
        grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        grpc_context.set_details("Watch is not served: poll Check")
        raise NotImplementedError("grpc.health.v1.Health/Watch")
        yield  # (a server stream)

    @staticmethod
    async def _answers(stage: DeploymentHandle) -> bool:
        try:
            await calls.within(stage.ping.remote(), HEALTH_PROBE_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001 - no replica, or none answering: not serving
            return False

    # -- the public interface: what the gRPC methods and the HTTP routes drive ------------------------------------

    def authenticate(self, metadata) -> None:
        """With auth.token_sha256 set, the call's metadata (gRPC) or headers (HTTP) must carry its bearer token
        (compared in constant time)."""
        expected = self.config.auth.token_sha256
        if expected and not auth.authenticated(metadata, expected):
            raise UnauthenticatedError("unauthenticated")

    async def plan(self, request: pb.GenerateRequest | pb.GenerateStreamRequest) -> api.Plan:
        """The validated plan of a request (tokenised off the event loop, on the one tokenising thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._parse, request)

    async def render_chat(self, messages: list[dict], tool_plan: tools.ToolPlan) -> str:
        """A chat's prompt text through the model's own tool template (on the tokenising thread)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizing, tools.render_prompt, self.tokenizer, messages, tool_plan)

    def text_steps(self, plan: api.Plan, timer: api.Timer, deadline: float) -> AsyncIterator[tuple[StepOutput, list[int], str]]:
        """Each step's kept tokens and new text, cut at the first stop sequence (and its ``logprobs``, where the
        request asks for them, cut to the kept tokens), until ``deadline``
        (time.monotonic()), also while a step is awaited: then the request's sessions are closed and
        RequestDeadlineError is raised."""
        return _before(deadline, self._text_steps(plan, timer), lambda: RequestDeadlineError(
            f"the request ran past limits.request_timeout_s ({self.config.limits.request_timeout_s:g}s)"))

    async def collect(self, plan: api.Plan, timer: api.Timer, deadline: float) -> api.Answer:
        """The whole answer: text, token ids, finish reason (and logprobs, where the request asks for them)."""
        answer = api.Answer()
        async for step, ids, delta in self.text_steps(plan, timer, deadline):
            answer.add(step, ids, delta)
        return answer

    async def serving(self) -> bool:
        """The prefill and verify stages can be placed and each has a replica that answers (Check, /health)."""
        essential = [stage for stage in self.stages.unplaceable if stage != "draft"]
        return not essential and all(await asyncio.gather(self._answers(self.prefill), self._answers(self.verify)))

    def _parse(self, request) -> api.Plan:
        essential = [why for stage, why in self.stages.unplaceable.items() if stage != "draft"]  # without a drafter: no speculation
        if essential:
            raise StageUnavailableError("; ".join(essential))
        return api.parse(request, self.config, self.target.tokenizer,
                         max_context=self.config.context_limit(self.target.max_context),  # kv_capacity bounds it too
                         vocab_size=self.target.vocab_size, drafters=self.drafters, default_drafter=self.default_drafter,
                         grammars=self.grammars)

    async def _text_steps(self, plan: api.Plan, timer: api.Timer) -> AsyncIterator[tuple[StepOutput, list[int], str]]:
        stream = TextStream(self.target.tokenizer, plan.stop)
        steps = self.decoder.steps(plan, timer)
        self.metrics.started(len(plan.prompt_ids))
        try:
            async for i, step in _enumerate(steps):
                ids, text = stream.push(step.token_ids)
                if step.logprobs is not None:  # (those of the kept tokens)
                    step.logprobs = step.logprobs[: len(ids)]
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
            await steps.aclose()  # closes the request's sessions

    def _fail(self, method: str, grpc_context, exc: Exception):
        code, message = to_status(exc)
        self.metrics.finished(method, code.name)
        grpc_context.set_code(code)
        grpc_context.set_details(message)
        raise exc  # Serve keeps a status set before raising (a plain return would report OK)

    # -- fail fast on stages that no node can host ---------------------------------------------

    def _check_placement(self) -> None:
        problems = unplaceable(self.config, ray.nodes())
        if problems != self.stages.unplaceable:
            for stage, why in problems.items():
                effect = "requests run without speculation" if stage == "draft" else "requests get UNAVAILABLE"
                logger.error("%s; %s until such a node joins", why, effect)
            self.stages.unplaceable = problems

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
            return {"verify_replica": await self.stages.call("verify", self.verify.policy_state.remote())}
        except Exception as exc:  # noqa: BLE001 - a report: say why it lacks the replica's part
            return {"verify_replica": {"error": str(unwrap(exc))}}

    async def stats(self) -> dict:
        """This replica: requests running, resident memory, the lost stage replicas it has recovered from, by
        stage, and the requests it has finished, by "<method> <outcome>" (as splitspec_requests_total counts them); the thread its
        methods run on (as the stages' ``loop_thread``)."""
        return {"replica_id": serve.get_replica_context().replica_id.unique_id, "active": self.decoder.active,
                "rss_bytes": rss_bytes(), "recoveries": dict(self.stages.recoveries), "requests": dict(self.metrics.outcomes),
                "loop_thread": threading.current_thread().name}

    async def collect_garbage(self) -> int:
        """Run Python's cycle collector now (see Stage.collect_garbage); returns what it found."""
        return gc.collect()

    async def recent_handoffs(self) -> list[dict]:
        """Where the last KV handoffs went: prefill node, verify node, bytes resolved, latency."""
        return list(self.decoder.handoffs)


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
