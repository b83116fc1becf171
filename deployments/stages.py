"""The three stage deployments: thin Ray Serve shells around the services/ engines.

Each replica owns one engine and runs every engine call on one worker thread
(the engines are not thread-safe, and the event loop stays free to take the
next call); torch uses ``threads`` cores. Verify calls of concurrent sessions
are batched into one target pass, and so are the prompts of concurrent
prefills (``deployments.batching``). Placement (labels / resources),
replicas and the router are set by ``deployments.app`` from the config.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import ray
from ray import serve

from deployments.batching import ContinuousBatcher
from deployments.config import AppConfig
from deployments.faults import FaultPoints
from deployments.metrics import SessionMetrics
from deployments.placement import pin_cpus
from deployments.priority import EnginePriority, set_thread_nice
from deployments.routing import pin
from deployments.status import DRAFT_FAILURES, unwrap
from services import eagle_draft
from services.draft import DraftEngine, DraftProposal, ProposeCall
from services.errors import CapacityError, SessionNotFoundError
from services.loading import DTYPES, LoadedModel, check_device, config_of, load_causal_lm, set_num_threads
from services.chained import ChainedCall, run_chained
from services.loop import Results, SpeculativeLoop, StepOutput, execute_async
from services.policy import AcceptanceCounts, AdaptiveK, CostModel, describe
from services.prefill import PrefillCall, PrefillEngine, PrefillProgress
from services.runner import warm_up
from services.sampling import SamplingParams
from services.verify import VerifyCall, VerifyEngine, VerifyResult

logger = logging.getLogger(__name__)

GAUGE_PERIOD_S = 1.0  # how often draft / verify replicas re-set their session gauges


@dataclass
class KVHandoff:
    """What prefill returns: the first token and a *reference* to the KV in the object store."""

    first_token: int | None  # None: the verifier computes ``prompt_rest`` and draws it
    kv_refs: list  # [ObjectRef[KVPayload]]: in a list so that Ray passes the reference, not the bytes
    kv_bytes: int
    put_at: float  # time.time() when the KV was put (the handoff latency starts here)
    prefill_node: str  # node id of the prefill replica
    feature_refs: list = field(default_factory=list)  # [ObjectRef[Tensor [n, hidden]]] prompt features for a feature drafter
    # the prompt's last positions, left to the verify session's first step (a prefix-cache hit that left at most
    # limits.local_prefill_tokens of them: services.prefill.PrefillCall.local_tokens); the KV is of those before
    prompt_rest: list[int] = field(default_factory=list)


@dataclass
class SessionOpened:
    replica_id: str  # pin every later call of the session here (deployments.routing.pin)
    node_id: str
    handoff_ms: float = 0.0  # KV put -> resolved by the verifier
    resolved_bytes: int = 0


@dataclass
class Speculation:
    """A request's loop as ``Verify.speculate`` runs it in the verify replica."""

    max_new_tokens: int  # prefill's token included
    eos: list[int]
    num_draft_tokens: int  # k; with ``adaptive``, the largest k the replica's policy takes
    adaptive: bool
    drafter: str
    prompt_ids: list[int]  # the context before prefill's token: a colocated drafter's session starts over it
    drafting: bool = True  # False: the target alone (a remote draft session lost with a recovered verify replica)
    draft_replica: str = ""  # the draft stage replica holding session ``draft_sid``; "" = this replica's own drafter
    draft_sid: str = ""
    tree_width: int = 1  # > 1: greedy steps draft trees (services.tree)


@dataclass
class _Steps:
    """A decode stream's steps (``Verify._start_steps``): their task and the verdicts it queues."""

    verdicts: asyncio.Queue
    task: asyncio.Task


@dataclass
class DraftFallback:
    """Yielded by ``Verify.speculate`` when a draft failure turned speculation off for the rest of the request."""

    when: str  # "start" or "propose"
    error: str  # the failure's type name


def model_dirs(config: AppConfig) -> tuple[Path, Path]:
    """The configured model folders, or the prepared default pair."""
    from services.models import default_pair

    target = Path(config.models.target) if config.models.target else default_pair.target_dir()
    draft = Path(config.models.draft) if config.models.draft else default_pair.drafter_dir()
    return target, draft


def load_target(config: AppConfig, stage: str = "") -> LoadedModel:
    """The target model, on ``stage``'s device and in its dtype (no stage: on the CPU, in models.dtype)."""
    if not stage:
        return load_causal_lm(model_dirs(config)[0], dtype=config.models.dtype)
    device = stage_device(config, stage)
    return load_causal_lm(model_dirs(config)[0], dtype=config.stage_dtype(stage), device=device)


def load_drafter(config: AppConfig, stage: str, target: LoadedModel | None = None) -> DraftEngine:
    """The draft engine on ``stage``'s device: the draft model, and the EAGLE head when the drafter folder has one,
    which reads ``target``'s frozen embeddings (default: the target loaded for them, the rest dropped)."""
    target_dir, draft_dir = model_dirs(config)
    head_path = eagle_draft.find(draft_dir)
    head = eagle_draft.load(head_path, target or load_target(config)) if head_path else None
    engine = DraftEngine(
        load_causal_lm(draft_dir, dtype=config.stage_dtype(stage), device=stage_device(config, stage)),
        max_sessions=config.limits.max_sessions,
        max_kv_bytes=config.limits.max_kv_bytes,
        max_context=getattr(config_of(target_dir), "max_position_embeddings", None),  # (the pair is checked by the ingress)
        eagle_head=head,
        weight_storage=DTYPES[config.models.draft_weights],
        draft_vocab_size=config.models.draft_vocab_size,
    )
    warm_up(engine.runner)
    return engine


def stage_device(config: AppConfig, stage: str) -> str:
    """The stage's configured device, checked here in its replica: a clear error naming stage and node if absent."""
    device = config.stage(stage).device
    check_device(device, where=f"stage {stage!r}, node {ray.get_runtime_context().get_node_id()}")
    return device


def _engine_thread(nice: int | None) -> None:
    """Start of a replica's engine thread: its niceness (stages.<stage>.engine_nice). On a CPU the engine thread is
    the critical path; Ray starts workers at nice 15, where every wakeup of Ray's own threads (nice 0) and of the
    other replicas preempts it (README, "Under load")."""
    if nice is not None and hasattr(os, "setpriority"):
        set_thread_nice(nice)


def rss_bytes() -> int:
    """This process's resident memory."""
    return psutil.Process().memory_info().rss


def _identity() -> tuple[str, str]:
    return serve.get_replica_context().replica_id.unique_id, ray.get_runtime_context().get_node_id()


class _Stage:
    """One engine, one worker thread."""

    stage = ""
    fault_methods: tuple[str, ...] = ()  # where deployments.faults may strike (tests only)

    def __init__(self, config: dict):
        self.config = AppConfig.model_validate(config)
        stage_config = self.config.stage(self.stage)
        pin_cpus(stage_config.placement.cpus, self.stage)  # (first: every thread started later inherits the set)
        set_num_threads(stage_config.threads)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"splitspec-{self.stage}",
                                            initializer=_engine_thread, initargs=(stage_config.engine_nice,))
        started_nice = self._executor.submit(os.getpriority, os.PRIO_PROCESS, 0).result()  # (0: this thread)
        self.cpus = sorted(self._executor.submit(os.sched_getaffinity, 0).result())  # the engine thread's CPU set
        self.priority = EnginePriority(started_nice, stage_config.saturated_nice, stage_config.saturated_calls)
        self.opened = 0  # sessions opened on this replica
        self.session_metrics = SessionMetrics(self.stage)  # batched passes (every stage); sessions (draft, verify)
        self.faults = FaultPoints(self.config.faults.enabled, self.fault_methods)
        if self.stage != "prefill":  # draft and verify hold sessions
            self._reporter = asyncio.get_event_loop().create_task(self._report_sessions())

    def _session_counts(self) -> tuple[int, int]:
        """(open sessions, KV bytes held); run on the engine thread, which is the only one that changes them."""
        sessions = getattr(self.engine, "sessions", ())  # (prefill holds none)
        return len(sessions), getattr(sessions, "kv_bytes", 0)

    async def stats(self) -> dict:
        """This replica's sessions: open now, opened in all, KV bytes held; its batched passes: how many ran, and
        the most sessions' calls one of them took, and the calls waiting for the next (``queued``); calls held by a
        fault (tests); its resident memory; its engine thread's niceness now, how often load changed it
        (deployments.priority), and its CPU set (``cpus``: placement.cpus, else every CPU the node offers); the thread
        its methods run on (``loop_thread``: the replica's own event loop with config.replica_one_loop, else Serve's
        thread for them)."""
        sessions, kv_bytes = await self._run(self._session_counts)
        return {"replica_id": _identity()[0], "sessions": sessions, "opened": self.opened, "kv_bytes": kv_bytes,
                "passes": self.batcher.passes, "largest_pass": self.batcher.largest_pass, "queued": self.batcher.queued,
                "held": self.faults.held, "rss_bytes": rss_bytes(), "engine_nice": self.priority.current,
                "engine_nice_switches": self.priority.switches, "loop_thread": threading.current_thread().name,
                "cpus": self.cpus}

    async def collect_garbage(self) -> int:
        """Run Python's cycle collector now (a soak's check: objects kept only by reference cycles, e.g. a failed
        call's traceback holding a zero-copy view of the object store, are freed when it runs); returns what it
        found."""
        return gc.collect()

    async def ping(self) -> str:
        """This replica's id, answered on the event loop (not behind an engine pass): it is up."""
        return _identity()[0]

    async def arm_fault(self, method: str, action: str, after: int = 0) -> str:
        """Tests only (faults.enabled): this replica's call of ``method`` number ``after + 1`` exits the process or
        holds (deployments.faults). Returns the replica's actor name, for ``ray.get_actor(name, namespace="serve")``."""
        self.faults.arm(method, action, after)
        return serve.get_replica_context().replica_id.to_full_id_str()

    async def release_fault(self) -> None:
        self.faults.release()

    def _batcher(self, run_pass: Callable, metrics: SessionMetrics | None = None, **options) -> ContinuousBatcher:
        """Continuous batching of this replica's engine calls, each pass recorded in the batch histograms of
        ``metrics``' stage (default: this replica's), with that stage's rows a pass."""
        metrics = metrics or self.session_metrics

        async def prioritized(calls: list) -> list:
            if (nice := self.priority.for_pass(len(calls))) is not None:
                self._executor.submit(self.priority.apply, nice)  # (one worker: it runs ahead of the pass)
            return await run_pass(calls)

        return ContinuousBatcher(prioritized, max_rows=self.config.batch_rows(metrics.stage),
                                 on_pass=lambda p: metrics.batched_pass(p.calls, p.rows), **options)

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _open_session(self, request_id: str, open_session: Callable, answered: str) -> None:
        """Run ``open_session()`` on the engine thread, then the fault point ``answered`` (a replica slow to answer
        after the open: tests only). A caller cancelled meanwhile (its client left, its deadline passed) never learns
        which replica holds the session, so nobody else would close it: it is closed here. An open already running
        on the engine thread runs to its end; the close queued behind it on that one thread undoes it."""
        try:
            await self._run(open_session)
            await self.faults.point(answered)
        except asyncio.CancelledError:
            self._executor.submit(self.engine.close, request_id)
            raise

    def _gone(self, request_id: str) -> None:
        """A session closed or reaped: no pass waits for its calls any more."""
        self.batcher.forget(request_id)

    async def _report_sessions(self) -> None:
        """Refresh the session gauges periodically (Ray drops a gauge that is not re-set within two report
        intervals), and close the sessions of requests that are gone (limits.session_idle_s)."""
        while True:
            if getattr(self, "batcher", None) is not None:  # (set last in the constructor)
                for request_id in await self._run(self.engine.sessions.reap, self.config.limits.session_idle_s):
                    self._gone(request_id)
                if getattr(self, "drafts", None) is not None:  # a colocated drafter's sessions (Verify)
                    for request_id in await self._run(self.drafts.sessions.reap, self.config.limits.session_idle_s):
                        self.batcher.forget(request_id)
                self.session_metrics.update(*await self._run(self._session_counts))
            await asyncio.sleep(GAUGE_PERIOD_S)


@serve.deployment(name="Prefill")
class Prefill(_Stage):
    """Stateless prefill of the target; the KV goes into the object store, its reference comes back."""

    stage = "prefill"
    fault_methods = ("prefill",)

    def __init__(self, config: dict):
        super().__init__(config)
        self.engine = PrefillEngine(load_target(self.config, self.stage),
                                    prefix_cache_bytes=self.config.limits.prefix_cache_bytes)
        warm_up(self.engine.runner)
        self.calls = itertools.count()
        # prompts that arrive while a pass runs are prefilled together in the next one (a prefill is never
        # followed by another call of its request: nothing to wait for after a pass)
        self.batcher = self._batcher(self._prefill_pass, gather_max_s=0.0)

    async def stats(self) -> dict:
        """``_Stage.stats``, prompts whose last positions went to the verifier (``local_prefills``), and the prefix
        cache: prompt tokens looked up and reused, prompts and bytes it holds."""
        cache = self.engine.prefix_cache
        counts = (0,) * 4
        if cache is not None:
            counts = await self._run(lambda: (cache.queried_tokens, cache.hit_tokens, len(cache), cache.nbytes))
        return {**await super().stats(), "local_prefills": self.engine.local_prefills,
                **dict(zip(("prefix_queried_tokens", "prefix_hit_tokens", "prefix_cached_prompts", "prefix_cached_bytes"),
                           counts))}

    async def _prefill_pass(self, calls: list[PrefillCall]) -> list:
        return await self._run(self.engine.prefill_batch, calls)

    async def prefill(self, prompt_ids: list[int], params: SamplingParams, features: bool = False,
                      local_tokens: int = 0) -> KVHandoff:
        """``features``: also put the prompt's target features (for a feature drafter) in the object store.
        ``local_tokens``: if the prefix cache leaves at most this many positions, hand them over uncomputed
        (``KVHandoff.prompt_rest``)."""
        await self.faults.point("prefill")
        call = PrefillCall(list(prompt_ids), params, features, request_id=str(next(self.calls)),
                           chunk=self.config.limits.prefill_chunk_tokens, local_tokens=local_tokens)
        try:
            # a long prompt goes chunk by chunk, each in a pass shared with other prompts: it does not stall
            # their first tokens
            while isinstance(result := await self.batcher.submit(call), PrefillProgress):
                call = dataclasses.replace(call, start=result.done)
        except BaseException:
            self._executor.submit(self.engine.drop, call.request_id)  # on the engine thread, after a pass in flight
            raise
        put_at = time.time()
        ref = ray.put(result.payload)  # zero-copy for a verifier on this node; one transfer to another node
        feature_refs = [ray.put(result.features)] if result.features is not None else []
        return KVHandoff(result.first_token, [ref], result.payload.nbytes, put_at, ray.get_runtime_context().get_node_id(),
                         feature_refs, result.prompt_rest)


@serve.deployment(name="Draft")
class Draft(_Stage):
    """Draft sessions (draft model, EAGLE head or prompt lookup), pinned to this replica."""

    stage = "draft"
    fault_methods = ("start", "started", "propose")

    def __init__(self, config: dict):
        super().__init__(config)
        self.engine = load_drafter(self.config, self.stage)
        # proposals of concurrent sessions draft in lockstep, one model pass per draft step for all of them; a
        # session calls again only after its verify step, so a pass does not wait for the sessions it answered
        self.batcher = self._batcher(self._propose_pass, gather_max_s=0.0)

    async def start(self, request_id: str, prompt_ids: list[int], params: SamplingParams, drafter: str,
                    handoff: KVHandoff | None = None) -> SessionOpened:
        """Open a session; a feature drafter resolves the prompt's features from the prefill's ``handoff`` here."""
        await self.faults.point("start")
        features = await handoff.feature_refs[0] if handoff is not None and handoff.feature_refs else None
        await self._open_session(
            request_id, lambda: self.engine.start(request_id, prompt_ids, params, drafter, features), "started")
        self.opened += 1
        return SessionOpened(*_identity())

    async def propose(self, request_id: str, k: int, accepts: tuple | list = (), forced: tuple | list = (),
                      guesses: int = 0, width: int = 1) -> DraftProposal:
        """Accept the verdicts since the last proposal (each ``(n_matches, next_token, features)``), then draft k tokens
        after ``forced`` ones — with ``guesses``, a block of k per likely verdict on them (the block the verifier is
        checking meanwhile: pre-drafting, services.loop)."""
        await self.faults.point("propose")
        return await self.batcher.submit(ProposeCall(request_id, k, list(forced), guesses, list(accepts), width))

    async def _propose_pass(self, calls: list[ProposeCall]) -> list:
        return await self._run(self.engine.propose_batch, calls)

    async def close(self, request_id: str) -> None:
        self.batcher.forget(request_id)
        await self._run(self.engine.close, request_id)



@serve.deployment(name="Verify")
class Verify(_Stage):
    """Verify sessions of the target, opened from a prefill's KV reference and pinned to this replica."""

    stage = "verify"
    fault_methods = ("open", "opened", "verify", "pass")  # pass: a batched target pass, before it runs

    def __init__(self, config: dict, draft=None):
        super().__init__(config)
        self.draft = draft  # the draft deployment: ``speculate`` asks it directly
        target = load_target(self.config, self.stage)
        self.engine = VerifyEngine(target, max_sessions=self.config.limits.max_sessions,
                                   max_kv_bytes=self.config.limits.max_kv_bytes,
                                   kv_capacity=self.config.stages.verify.kv_capacity or None,
                                   pass_slots=self.config.stages.verify.pass_slots or None)
        warm_up(self.engine.runner)
        self._decoding: set[str] = set()  # sessions decoding as a stream (``decode``) until they close
        self._ahead: dict[str, _Steps] = {}  # steps started by ``open``, before their ``decode`` call takes them
        self._prompt_rows: dict[str, int] = {}  # sessions opened with the prompt's rest: rows before pending, to come
        self.decode_streams = 0  # decode calls in all
        # speculation.colocate_drafter: a drafter of this replica's own, on the target's device and engine thread
        # (the EAGLE head on the target's embeddings); ``speculate`` asks it without a stage hop
        # and drafts with it in the passes of ``batcher`` (services.chained: a step is one engine call)
        self.drafts: DraftEngine | None = None
        self.draft_metrics = SessionMetrics("draft")  # the colocated drafter's passes, in the draft stage's histograms
        self.draft_passes, self.draft_largest_pass = 0, 0
        if self.config.speculation.colocate_drafter:
            self.drafts = load_drafter(self.config, self.stage, target)
        # what the adaptive policy of ``speculate`` learns here, per drafter: step costs and acceptance
        self.costs: dict[str, CostModel] = defaultdict(CostModel)
        self.acceptance: dict[str, AcceptanceCounts] = defaultdict(AcceptanceCounts)
        self.batcher = self._batcher(self._verify_pass)

    async def stats(self) -> dict:
        """``_Stage.stats``, the decode streams running now (``decoding``) and started in all (``decode_streams``),
        and the colocated drafter's open sessions and batched passes (``draft_sessions``, ``draft_passes``,
        ``draft_largest_pass``; 0 without one); the forward the target runs (``runner``: FastLlamaRunner, the
        compact CPU one, or BatchInvariantRunner, transformers' on GPUs) and its sessions a pass (``pass_slots``)."""
        draft = {"draft_sessions": 0, "draft_passes": self.draft_passes, "draft_largest_pass": self.draft_largest_pass}
        if self.drafts is not None:
            draft["draft_sessions"] = await self._run(lambda: len(self.drafts.sessions))
        runner = {"runner": type(self.engine.runner).__name__, "pass_slots": getattr(self.engine.runner, "slots", None)}
        return {**await super().stats(), "decoding": len(self._decoding), "decode_streams": self.decode_streams,
                **draft, **runner}

    async def decode(self, request_id: str, max_tokens: int, stop_ids: list[int],
                     opening: tuple[KVHandoff, SamplingParams] | None = None) -> AsyncIterator[SessionOpened | VerifyResult]:
        """Decode without drafts, as one streamed call: a verdict per step, each step joining the batched passes as a
        verify call does, until a token in ``stop_ids``, ``max_tokens`` steps, ``close`` or the caller's cancel.

        Speculation off then costs one stage call per request, not one per token, and a session's next step joins
        the very next pass: the steps run in a task of their own that does not wait for the stream's reader (vLLM's
        engine loop, where a running request is in every step and its outputs are queued for the client).

        ``opening`` (a prefill's handoff and the sampling parameters): open the session first (``open``) and yield
        its ``SessionOpened`` before the verdicts. The first step then follows the open on this replica, and the
        pass after the open waits for it (``ContinuousBatcher.expect``): the second token takes one pass, not the
        rest of a running pass and one more after a round trip through the ingress. Without one, the steps an
        ``open`` with ``decode`` started are the ones streamed (the same, with the open a call of its own)."""
        stepping = None
        try:
            if opening is not None:
                opened = await self.open(request_id, *opening, decode=(max_tokens, stop_ids))
            # (the steps an open started: this call's, or an earlier ``open`` call's with ``decode``)
            stepping = self._ahead.pop(request_id, None) or self._start_steps(request_id, max_tokens, stop_ids)
            if opening is not None:
                yield opened
            while (item := await stepping.verdicts.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            if stepping is not None:
                stepping.task.cancel()
            self._decoding.discard(request_id)
            self.batcher.forget(request_id)  # (if it never made its first call, no pass waits for it)
            if opening is not None:
                # the session this call opened ends with it, whatever ended it: a caller cancelled during the open
                # never learns where the session is. On the engine thread, so after an open still running there.
                self._executor.submit(self.engine.close, request_id)

    def _start_steps(self, request_id: str, max_tokens: int, stop_ids: list[int]) -> _Steps:
        """A session's decode steps, in a task of their own: each joins the next batched pass as a verify call does,
        its verdict queued for the stream's reader, until a token in ``stop_ids``, ``max_tokens`` steps or close."""
        stop = set(stop_ids)
        verdicts: asyncio.Queue = asyncio.Queue()  # VerifyResult per step; then None (the end) or the exception

        async def steps() -> None:
            try:
                for _ in range(max_tokens):
                    await self.faults.point("verify")  # (every step counts as a verify call)
                    if request_id not in self._decoding:  # closed meanwhile
                        break
                    verdict = await self.batcher.submit(self._verify_call(request_id, []))
                    verdicts.put_nowait(verdict)
                    if stop.intersection(verdict.token_ids):
                        break
                verdicts.put_nowait(None)
            except Exception as exc:  # noqa: BLE001 - raised to the reader
                verdicts.put_nowait(exc)
            finally:
                # no further call comes: the next pass must not wait for one (it would, up to the batcher's gather
                # bound, until the reader has taken the last verdict and the stream has ended)
                self.batcher.forget(request_id)

        self._decoding.add(request_id)
        self.decode_streams += 1
        return _Steps(verdicts, asyncio.get_running_loop().create_task(steps()))

    async def speculate(self, request_id: str, opening: tuple[KVHandoff, SamplingParams, bool],
                        spec: Speculation) -> AsyncIterator[SessionOpened | StepOutput | DraftFallback]:
        """Run a request's speculative loop here, next to the target, as one streamed call: open its verify session
        from the prefill's handoff (``opening``: handoff, sampling parameters, features) and yield the
        SessionOpened, then prefill's token and every step's StepOutput (a DraftFallback before the step after
        drafting failed; the answer is the same).

        Verify calls join this replica's batched passes directly, and the steps run in a task of their own, so
        that the delivery of a step to the ingress overlaps the next step. Proposals come from this replica's own
        drafter (``spec.draft_replica`` "", with speculation.colocate_drafter: no stage hop at all, and a step is
        one call of the batched passes, its proposal drafted in the pass right before its verification —
        services.chained; the drafter's session starts here over ``spec.prompt_ids`` and the prefill's features)
        or from the draft replica holding the request's session, asked directly (one hop a step instead of two).
        With ``spec.adaptive`` the replica's own policy picks k for every step from what it measured here; a
        pinned k's steps are recorded in the same costs. The sessions this call opened close when it ends,
        whatever ended it."""
        handoff, params, features = opening
        local = spec.drafting and not spec.draft_replica
        fell_back: list[DraftFallback] = []  # at most one: then drafting is off
        stepping = None

        def draft_failed(exc: BaseException) -> None:
            """A draft failure: the request goes on with the target alone (the answer is the same); anything else
            is raised."""
            cause = unwrap(exc)
            if not isinstance(cause, DRAFT_FAILURES + (asyncio.TimeoutError,)):
                raise exc
            fell_back.append(DraftFallback("propose", type(cause).__name__))

        async def propose(p):  # the remote drafter
            try:
                return await asyncio.wait_for(
                    remote.propose.remote(spec.draft_sid, p.k, p.accepts, p.forced, p.guesses, p.width),
                    timeout=self.config.limits.stage_timeout_s)
            except Exception as exc:  # noqa: BLE001
                draft_failed(exc)
                return None

        async def propose_and_verify(p) -> Results:  # the local drafter: one call of the batched passes
            await self.faults.point("verify")
            step = await self.batcher.submit(ChainedCall(ProposeCall(request_id, p.k, list(p.forced), p.guesses,
                                                                     list(p.accepts), p.width)))
            if isinstance(step.verdict, Exception):
                raise step.verdict
            results = Results(verdict=step.verdict, propose_s=step.propose_s, verify_s=step.verify_s)
            if isinstance(step.proposal, Exception):
                draft_failed(step.proposal)
                results.draft_failed = True
            else:
                results.proposal = step.proposal
            return results

        async def verify(v):
            await self.faults.point("verify")
            return await self.batcher.submit(self._verify_call(request_id, v.draft_ids, v.probs, v.parents))

        try:
            yield await self.open(request_id, handoff, params, features)
            drafting = spec.drafting
            if local:
                prompt_features = await handoff.feature_refs[0] if handoff.feature_refs else None
                try:
                    await self._run(self.drafts.start, request_id, spec.prompt_ids, params, spec.drafter, prompt_features)
                except (CapacityError, SessionNotFoundError) as exc:  # drafter full: the target alone
                    drafting = False
                    yield DraftFallback("start", type(exc).__name__)
            remote = self.draft.options(session_id=pin(spec.draft_replica)) if spec.draft_replica else None
            first_token = handoff.first_token
            if first_token is None:  # the prompt's last positions: the session's first step computes them
                await self.faults.point("verify")
                (first_token,) = (await self.batcher.submit(self._verify_call(request_id, []))).token_ids
            del handoff, opening  # (the prefill's KV and features are held by the sessions now)
            policy = None
            if spec.adaptive and drafting:
                policy = AdaptiveK(self.costs[spec.drafter], self.acceptance[spec.drafter], k_max=spec.num_draft_tokens,
                                   load=lambda: len(self.engine.sessions),
                                   max_load=self.config.speculation.off_above_concurrency, width=spec.tree_width)
            loop = SpeculativeLoop(first_token, max_new_tokens=spec.max_new_tokens,
                                   eos=set(spec.eos), num_draft_tokens=spec.num_draft_tokens, drafting=drafting,
                                   policy=policy, tree_width=spec.tree_width, chained=local,
                                   costs=self.costs[spec.drafter] if drafting else None)
            outputs: asyncio.Queue = asyncio.Queue()  # per step: DraftFallback?, StepOutput; then None or the exception

            async def steps() -> None:
                """The loop, in a task of its own: the next step's calls go out as soon as a step's verdict is in,
                while the stream delivers that step (as ``decode``'s steps do)."""
                results = None
                try:
                    while (item := loop.advance(results)) is not None:
                        if isinstance(item, StepOutput):
                            if fell_back:
                                outputs.put_nowait(fell_back.pop())
                            outputs.put_nowait(item)
                            results = None
                        elif item.verify_proposal:
                            results = await propose_and_verify(item.propose)
                        else:
                            results = await execute_async(item, propose, verify)
                    outputs.put_nowait(None)
                except Exception as exc:  # noqa: BLE001 - raised to the reader
                    outputs.put_nowait(exc)
                finally:
                    self.batcher.forget(request_id)  # no further call comes: the next pass must not wait for one

            stepping = asyncio.get_running_loop().create_task(steps())
            while (output := await outputs.get()) is not None:
                if isinstance(output, Exception):
                    raise output
                yield output
        finally:
            if stepping is not None:
                stepping.cancel()
            self.batcher.forget(request_id)
            self._executor.submit(self.engine.close, request_id)  # (on the engine thread: after an open running there)
            if local:
                self._executor.submit(self.drafts.close, request_id)

    async def policy_state(self) -> dict:
        """What the adaptive policy of ``speculate`` has learned on this replica, per drafter (services.policy.describe)."""
        return {drafter: describe(costs, self.acceptance.get(drafter)) for drafter, costs in self.costs.items()}

    async def open(self, request_id: str, handoff: KVHandoff, params: SamplingParams, features: bool = False,
                   decode: tuple[int, list[int]] | None = None) -> SessionOpened:
        """``features``: each verdict carries the target's features of the accepted positions (feature drafters).

        A handoff with ``prompt_rest`` (a prefix-cache hit that left the prompt's last positions to this replica:
        limits.local_prefill_tokens) opens the session with them still to compute: its first step (a verify call
        without drafts, or a decode stream's first) computes them in a batched pass and its verdict is the first token.

        ``decode`` (max_tokens, stop_ids): the session starts decoding here at once, as ``decode`` would, and its
        verdicts wait for the caller's ``decode`` call, which streams them (by value: speculation.stream_by_value).
        The first step follows the open on this replica, and the pass after the open waits for it, as with
        ``decode``'s opening; the stream's call carries no object reference, so it may go over Serve's gRPC."""
        await self.faults.point("open")
        if decode is not None:
            self.batcher.expect(request_id)
        try:
            (ref,) = handoff.kv_refs
            payload = await ref  # resolved here, in the verifier: the ingress only ever held the reference
            handoff_ms = (time.time() - handoff.put_at) * 1000
            await self._open_session(
                request_id, lambda: self.engine.open(request_id, payload, handoff.first_token, params, features=features,
                                                     prompt_rest=handoff.prompt_rest), "opened")
        except BaseException:
            self.batcher.forget(request_id)  # (no step follows: the next pass must not wait for one)
            raise
        if handoff.prompt_rest:
            self._prompt_rows[request_id] = len(handoff.prompt_rest) - 1  # (rows its first call adds: _verify_call)
        if decode is not None:
            # (until the caller's decode call takes them; a caller lost in between leaves at most max_tokens
            # verdicts here until the session is reaped, limits.session_idle_s: ``_gone``)
            self._ahead[request_id] = self._start_steps(request_id, *decode)
        self.opened += 1
        return SessionOpened(*_identity(), handoff_ms=handoff_ms, resolved_bytes=payload.nbytes)

    async def verify(self, request_id: str, draft_ids: list[int], draft_probs=None, tree_parents=None) -> VerifyResult:
        """Joins the next target pass with the other sessions' verify calls (continuous batching); ``tree_parents``:
        the drafts are a tree (services.tree). The first call of a session opened with the prompt's last positions
        (``KVHandoff.prompt_rest``) takes no drafts: its verdict is the first token."""
        await self.faults.point("verify")
        return await self.batcher.submit(self._verify_call(request_id, draft_ids, draft_probs, tree_parents))

    def _verify_call(self, request_id: str, draft_ids, draft_probs=None, tree_parents=None) -> VerifyCall:
        """A verify call for the batcher; a session's first after a local prefill counts its prompt rows too."""
        return VerifyCall(request_id, list(draft_ids), draft_probs, tree_parents=tuple(tree_parents) if tree_parents else None,
                          prompt_rows=self._prompt_rows.pop(request_id, 0))

    async def _verify_pass(self, calls: list[VerifyCall | ChainedCall]) -> list:
        """One target pass; with chained calls (``speculate`` with the local drafter), their proposals in one draft
        pass right before it, on the engine thread (services.chained)."""
        await self.faults.point("pass")  # (tests: a held pass lets calls queue, so that the next one takes them all)
        proposals = [call.propose for call in calls if isinstance(call, ChainedCall)]
        if not proposals:
            return await self._run(self.engine.verify_batch, calls)
        results = await self._run(run_chained, self.drafts, self.engine, calls)
        self.draft_passes += 1
        self.draft_largest_pass = max(self.draft_largest_pass, len(proposals))
        self.draft_metrics.batched_pass(len(proposals), sum(p.rows for p in proposals))
        return results

    async def close(self, request_id: str) -> None:
        self._gone(request_id)
        await self._run(self.engine.close, request_id)

    def _gone(self, request_id: str) -> None:
        """``_Stage._gone``, and what the replica holds for the session beside the engine: its decode stream's mark,
        its first call's prompt rows, the steps an ``open`` started that no ``decode`` call came for (a caller lost
        in between: cancelled, their verdicts dropped, when the session closes or is reaped)."""
        super()._gone(request_id)
        self._decoding.discard(request_id)
        self._prompt_rows.pop(request_id, None)
        if (ahead := self._ahead.pop(request_id, None)) is not None:
            ahead.task.cancel()

