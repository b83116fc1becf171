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
import contextvars
import dataclasses
import gc
import itertools
import logging
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import ray
from ray import serve

from deployments.batching import ContinuousBatcher
from deployments.config import AppConfig
from deployments.drafting import LOCAL, REMOTE, LocalDrafting, RemoteDrafting
from deployments.faults import FaultPoints
from deployments.metrics import SessionMetrics
from deployments.placement import pin_cpus
from deployments.priority import EnginePriority, set_thread_nice
from deployments.status import DRAFT_FAILURES, unwrap
from services import eagle_draft
from services.draft import DraftEngine, DraftProposal, ProposeCall
from services.errors import SessionNotFoundError
from services.loading import DTYPES, LoadedModel, check_device, config_of, load_causal_lm, load_head_parts, set_num_threads
from services.chained import ChainedCall, run_chained
from services.loop import Results, SpeculativeLoop, StepOutput, execute_async
from services.policy import DECLINED_LOAD, AcceptanceCounts, AdaptiveK, CostModel, RequestGate, RequestPolicy, adaptive_k, decide, describe
from services.prefill import PrefillCall, PrefillEngine, PrefillProgress
from services.runner import warm_up
from services.sampling import SamplingParams, reseeded
from services.verify import VerifyCall, VerifyEngine

logger = logging.getLogger(__name__)

GAUGE_PERIOD_S = 1.0  # how often draft / verify replicas re-set their session gauges
RECENT_TIMELINES = 16  # loops whose timelines a verify replica keeps (``Verify.recent_timelines``)


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
    drafting: str = ""  # where the request's loop drafts: "local", "remote" (deployments.drafting), "" = it does not
    declined: str = ""  # why an adaptive request runs without a drafter (services.policy.RequestGate), if it does
    overlap: bool = False  # it pre-drafts


@dataclass
class Speculation:
    """A request's loop as the verify replica runs it (``Verify.open``, ``Verify.speculate``)."""

    max_new_tokens: int  # prefill's token included
    eos: list[int]
    prompt_ids: list[int]  # the context before prefill's token: the drafter's session starts over it
    drafter: str = ""  # the drafter kind; "" = the target alone
    num_draft_tokens: int = 0  # k; with ``adaptive``, the largest k the replica's policy takes
    adaptive: bool = False
    overlap: bool | None = None  # pre-drafting as the request asks (None: the server's default)


@dataclass
class _Loop:
    """A request's loop in the verify replica (``Verify.open``): its task and the outputs it queues for the stream."""

    outputs: asyncio.Queue  # SessionEvent | StepOutput, then None (the end) or the exception
    task: asyncio.Task


@dataclass
class DraftFallback:
    """Yielded by ``Verify.speculate`` when a draft failure turned speculation off (the answer is the same)."""

    when: str  # "start" or "propose"
    error: str  # the failure's type name


@dataclass
class DraftResumed:
    """Yielded by ``Verify.speculate`` when drafting resumed on a live draft replica after its replica was lost."""

    after_tokens: int


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
    which reads ``target``'s frozen embeddings and last layer (default: those alone, read from the target's folder:
    a draft stage of its own does not load the target)."""
    target_dir, draft_dir = model_dirs(config)
    head_path = eagle_draft.find(draft_dir)
    head = eagle_draft.load(head_path, target or load_head_parts(target_dir)) if head_path else None
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
        start = time.perf_counter()
        proposals = await self._run(self.engine.propose_batch, calls)
        for proposal in proposals:  # (what the pass took here: a verify replica's timeline tells it from the hop)
            if isinstance(proposal, DraftProposal):
                proposal.draft_s = time.perf_counter() - start
        return proposals

    async def close(self, request_id: str) -> None:
        self.batcher.forget(request_id)
        await self._run(self.engine.close, request_id)



@serve.deployment(name="Verify")
class Verify(_Stage):
    """Verify sessions of the target, opened from a prefill's KV reference and pinned to this replica; each runs its
    request's speculative loop here, next to the target and its KV (the one served driver)."""

    stage = "verify"
    fault_methods = ("open", "opened", "verify", "pass")  # pass: a batched target pass, before it runs

    def __init__(self, config: dict, prefill=None, draft=None):
        super().__init__(config)
        self.prefill = prefill  # the prefill deployment: a remote drafter's restart needs the target's features
        self.draft = draft  # the draft deployment (speculation.drafting remote): asked directly, replica to replica
        self.remote = self.config.remote_drafting()
        target = load_target(self.config, self.stage)
        self.engine = VerifyEngine(target, max_sessions=self.config.limits.max_sessions,
                                   max_kv_bytes=self.config.limits.max_kv_bytes,
                                   kv_capacity=self.config.stages.verify.kv_capacity or None,
                                   pass_slots=self.config.stages.verify.pass_slots or None)
        warm_up(self.engine.runner)
        self._loops: dict[str, _Loop] = {}  # loops ``open`` started whose ``speculate`` call has not taken them yet
        self._prompt_rows: dict[str, int] = {}  # sessions opened with the prompt's rest: rows before pending, to come
        # drafting local: a drafter of this replica's own, on the target's device and engine thread (the EAGLE head
        # on the target's embeddings), drafting in the passes of ``batcher`` (services.chained: a step is one call)
        self.drafts: DraftEngine | None = None if self.remote else load_drafter(self.config, self.stage, target)
        self.draft_metrics = SessionMetrics("draft")  # the local drafter's passes, in the draft stage's histograms
        self.draft_passes, self.draft_largest_pass = 0, 0
        # what the adaptive policy learns here, per drafter: step costs, acceptance, and whether requests speculate
        self.costs: dict[str, CostModel] = defaultdict(CostModel)
        self.acceptance: dict[str, AcceptanceCounts] = defaultdict(AcceptanceCounts)
        self.gates = defaultdict(lambda: RequestGate(self.config.speculation.explore_every))
        self.timelines: deque[dict] = deque(maxlen=RECENT_TIMELINES)  # the last loops' rounds (``timelines``)
        self.batcher = self._batcher(self._verify_pass)
        logger.info("speculating requests draft %s (speculation.drafting %s)", LOCAL if not self.remote else
                    f"{REMOTE}ly in the draft stage", self.config.speculation.drafting)

    async def stats(self) -> dict:
        """``_Stage.stats``; where requests draft (``drafting``: local or remote, speculation.drafting), the loops
        running here (``loops``), the times a loop that lost its draft replica found a live one
        (``draft_replica_answered``), the local drafter's open sessions and batched passes (``draft_sessions``,
        ``draft_passes``, ``draft_largest_pass``; 0 without one); the forward the target runs (``runner``:
        FastLlamaRunner, the compact CPU one, or BatchInvariantRunner, transformers' on GPUs) and its sessions a pass
        (``pass_slots``)."""
        draft = {"draft_sessions": 0, "draft_passes": self.draft_passes, "draft_largest_pass": self.draft_largest_pass}
        if self.drafts is not None:
            draft["draft_sessions"] = await self._run(lambda: len(self.drafts.sessions))
        runner = {"runner": type(self.engine.runner).__name__, "pass_slots": getattr(self.engine.runner, "slots", None)}
        return {**await super().stats(), "drafting": REMOTE if self.remote else LOCAL, "loops": self.running,
                "draft_replica_answered": self.draft_replica_answered, **draft, **runner}

    running = 0  # loops running on this replica
    draft_replica_answered = 0  # times a loop that lost its draft replica found a live one

    async def open(self, request_id: str, handoff: KVHandoff, params: SamplingParams, spec: Speculation) -> SessionOpened:
        """Open the request's verify session from the prefill's handoff and start its loop here (``speculate``
        streams its steps). Goes by reference: the handoff carries object references.

        A handoff with ``prompt_rest`` (a prefix-cache hit that left the prompt's last positions to this replica:
        limits.local_prefill_tokens) opens the session with them still to compute: the loop's first step computes
        them in a batched pass and its verdict is the first token. The pass after the open waits for that first
        step (``ContinuousBatcher.expect``). A caller lost before its ``speculate`` call leaves at most the
        request's steps queued here until the session is reaped (limits.session_idle_s)."""
        await self.faults.point("open")
        policy, declined = self._policy(spec, params)
        self.batcher.expect(request_id)
        try:
            (ref,) = handoff.kv_refs
            payload = await ref  # resolved here, in the verifier: the ingress only ever held the reference
            handoff_ms = (time.time() - handoff.put_at) * 1000
            await self._open_session(request_id, lambda: self.engine.open(
                request_id, payload, handoff.first_token, params, features=policy.reads_features,
                prompt_rest=handoff.prompt_rest), "opened")
        except BaseException:
            self.batcher.forget(request_id)  # (no step follows: the next pass must not wait for one)
            raise
        if handoff.prompt_rest:
            self._prompt_rows[request_id] = len(handoff.prompt_rest) - 1  # (rows its first call adds: _verify_call)
        outputs: asyncio.Queue = asyncio.Queue()
        task = asyncio.get_running_loop().create_task(  # (outside the call's request: its stage calls outlive it)
            self._loop(request_id, handoff, params, spec, policy, outputs), context=contextvars.Context())
        self._loops[request_id] = _Loop(outputs, task)
        self.opened += 1
        where = (REMOTE if self.remote else LOCAL) if policy.drafter else ""
        return SessionOpened(*_identity(), handoff_ms=handoff_ms, resolved_bytes=payload.nbytes, drafting=where,
                             declined=declined, overlap=policy.overlap)

    async def speculate(self, request_id: str) -> AsyncIterator[StepOutput | DraftFallback | DraftResumed]:
        """The steps of the loop ``open`` started: prefill's token, then every step's StepOutput (a DraftFallback
        before the step after drafting failed, a DraftResumed when it resumed; the answer is the same). Carries no
        object reference, so it goes by value over Serve's gRPC. The session closes when the stream ends, whatever
        ended it."""
        running = self._loops.pop(request_id, None)
        if running is None:
            raise SessionNotFoundError(f"no loop of session {request_id!r} on this replica (restarted, or reaped)")
        try:
            while (item := await running.outputs.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            running.task.cancel()
            self.batcher.forget(request_id)
            self._prompt_rows.pop(request_id, None)
            self._executor.submit(self.engine.close, request_id)  # (on the engine thread: after a pass running there)

    def _policy(self, spec: Speculation, params: SamplingParams) -> tuple[RequestPolicy, str]:
        """The request's policy (services.policy.decide), and why the gate declined its drafter, if it did."""
        policy = decide(spec.drafter, spec.num_draft_tokens, adaptive=spec.adaptive, greedy=params.greedy,
                        tree_width=self.config.speculation.tree_width, remote=self.remote,
                        overlap=self.config.speculation.overlap if spec.overlap is None else spec.overlap)
        declined = ""
        if policy.adaptive:  # where speculation does not pay: no drafter at all
            adaptive = self._adaptive_k(policy, opening=1)
            if not policy.overlap:
                declined = self.gates[policy.drafter].decline(adaptive)
            elif adaptive.overloaded:  # (a pre-draft costs the verifier nothing but its drafts' rows)
                declined = DECLINED_LOAD
        return (decide("", 0, adaptive=False, greedy=params.greedy) if declined else policy), declined

    def _adaptive_k(self, policy: RequestPolicy, opening: int = 0) -> AdaptiveK | None:
        """The request's AdaptiveK; its load is this replica's sessions (``opening``: and the one being opened)."""
        return adaptive_k(policy, self.costs[policy.drafter], self.acceptance[policy.drafter],
                          load=lambda: len(self.engine.sessions) + opening,
                          max_load=self.config.speculation.off_above_concurrency)

    async def _loop(self, request_id: str, handoff: KVHandoff, params: SamplingParams, spec: Speculation,
                    policy: RequestPolicy, outputs: asyncio.Queue) -> None:
        """The request's loop (services.loop's SpeculativeLoop): verify calls join this replica's batched passes;
        proposals come from its own drafter or from the draft stage (deployments.drafting). It runs in a task of its
        own, so that the delivery of a step overlaps the next one. A draft failure turns drafting off (the answer
        is the same); a lost draft replica is watched for a live one, and drafting resumes there."""
        drafting: LocalDrafting | RemoteDrafting | None = None
        back: asyncio.Task | None = None  # after a lost draft replica: True once a draft replica answers
        emitted: list[int] = []

        def draft_failed(exc: BaseException, when: str) -> None:
            nonlocal back
            cause = unwrap(exc)
            if not isinstance(cause, DRAFT_FAILURES + (asyncio.TimeoutError,)):
                raise exc
            outputs.put_nowait(DraftFallback(when, type(cause).__name__))
            if isinstance(drafting, RemoteDrafting) and _replica_lost(cause) and back is None:
                back = asyncio.get_running_loop().create_task(self._draft_answers(drafting))

        async def propose(p):
            try:
                return await drafting.propose(p)
            except Exception as exc:  # noqa: BLE001
                draft_failed(exc, "propose")
                return None

        async def propose_and_verify(p) -> Results:
            await self.faults.point("verify")
            step = await drafting.propose_and_verify(p)
            if isinstance(step.verdict, Exception):
                raise step.verdict
            results = Results(verdict=step.verdict, propose_s=step.propose_s, verify_s=step.verify_s)
            if isinstance(step.proposal, Exception):
                draft_failed(step.proposal, "propose")
                results.draft_failed = True
            else:
                results.proposal = step.proposal
            return results

        async def verify(v):
            await self.faults.point("verify")
            return await self.batcher.submit(self._verify_call(request_id, v.draft_ids, v.probs, v.parents))

        rounds: list[dict] = []  # the loop's timeline (``timelines``)
        start = time.perf_counter()

        async def timed(execute, item):
            begun = time.perf_counter()
            results = await execute
            proposal = results.proposal
            rounds.append({"at_ms": _ms(begun - start), "ms": _ms(time.perf_counter() - begun),
                           "propose_ms": _ms(results.propose_s), "verify_ms": _ms(results.verify_s),
                           "draft_ms": _ms(results.propose_s if item.verify_proposal else
                                           proposal.draft_s if proposal is not None else 0.0),
                           "overlap": bool(item.propose and item.verify), "chained": item.verify_proposal,
                           "drafted": len(item.verify.draft_ids) if item.verify else len(proposal.token_ids) if proposal else 0,
                           "accepted": results.verdict.n_matches if results.verdict else 0})
            return results

        self.running += 1
        starting = None  # the drafter's session start, beside the first step
        try:
            if policy.drafter:
                drafting = (RemoteDrafting(self.draft, request_id, self.config.limits.stage_timeout_s) if self.remote
                            else LocalDrafting(self, request_id))
                starting = asyncio.ensure_future(drafting.start(spec.prompt_ids, params, policy.drafter, handoff))
            first_token = handoff.first_token
            if first_token is None:  # the prompt's last positions: the session's first step computes them
                await self.faults.point("verify")
                (first_token,) = (await self.batcher.submit(self._verify_call(request_id, []))).token_ids
            del handoff  # (the prefill's KV and features are held by the sessions now)
            adaptive = self._adaptive_k(policy) if drafting is not None else None
            loop = SpeculativeLoop(first_token, max_new_tokens=spec.max_new_tokens, eos=set(spec.eos),
                                   num_draft_tokens=policy.num_draft_tokens, drafting=drafting is not None,
                                   policy=adaptive, overlap=policy.overlap, guesses=policy.guesses,
                                   tree_width=policy.tree_width, chained=isinstance(drafting, LocalDrafting),
                                   costs=self.costs[policy.drafter] if drafting is not None else None)
            first = loop.advance()  # the first token goes out while the drafter starts
            outputs.put_nowait(first)
            emitted += first.token_ids
            if starting is not None:
                try:
                    await starting
                except Exception as exc:  # noqa: BLE001 - a drafter that cannot start: the target alone
                    draft_failed(exc, "start")
                    drafting.close()
                    drafting, loop.drafting = None, False
                    if back is not None:  # (no session to resume)
                        back.cancel()
                        back = None
            results = None
            while (item := loop.advance(results)) is not None:
                if isinstance(item, StepOutput):
                    outputs.put_nowait(item)
                    emitted += item.token_ids
                    results = None
                    if back is not None and back.done():  # a draft replica answers again: a fresh session there
                        answered, back = back.result(), None
                        if answered and await self._restart_drafting(drafting, spec, params, policy, emitted):
                            loop.resume_drafting()
                            outputs.put_nowait(DraftResumed(len(emitted)))
                elif item.verify_proposal:
                    results = await timed(propose_and_verify(item.propose), item)
                else:
                    results = await timed(execute_async(item, propose, verify), item)
            outputs.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - raised to the stream's reader
            outputs.put_nowait(exc)
        finally:
            self.running -= 1
            if starting is not None and not starting.done():
                starting.cancel()
            self.timelines.append({"session": request_id, "drafting": drafting.where if drafting else "",
                                   "drafter": policy.drafter, "overlap": policy.overlap, "rounds": rounds})
            self.batcher.forget(request_id)  # no further call comes: the next pass must not wait for one
            if back is not None:
                back.cancel()
            if drafting is not None:
                drafting.close()

    async def _draft_answers(self, drafting: RemoteDrafting) -> bool:
        """True once a draft replica answers again after one was lost (``draft_replica_answered`` counts it)."""
        answered = await drafting.answers()
        self.draft_replica_answered += answered
        return answered

    async def _restart_drafting(self, drafting: RemoteDrafting, spec: Speculation, params: SamplingParams,
                                policy: RequestPolicy, emitted: list[int]) -> bool:
        """A fresh draft session over the context and every emitted token but the last (which the drafter continues
        from), with the target's features of all of them from a prefill where the kind reads them."""
        ids = spec.prompt_ids + emitted[:-1]
        params = reseeded(params, len(emitted))
        try:
            handoff = None
            if policy.reads_features:
                handoff = await asyncio.wait_for(_awaited(self.prefill.prefill.remote(ids, params, True)),
                                                 timeout=self.config.limits.stage_timeout_s)
            await drafting.start(ids, params, policy.drafter, handoff)
            return True
        except Exception as exc:  # noqa: BLE001 - stay with the target alone
            logger.warning("session %s: the draft stage is still failing (%s); going on without speculation",
                           drafting.session_id, unwrap(exc))
            return False

    async def recent_timelines(self) -> list[dict]:
        """The last loops' timelines, oldest first: per round of stage calls, when it began and what it took (ms:
        ``propose`` as this replica waited for it, the drafter's own ``draft`` pass within it, ``verify``; the rest
        of a remote proposal is the hop), whether the proposal ran beside the verification (``overlap``: pre-drafting)
        or right before it in one pass (``chained``: the local drafter), tokens drafted and accepted."""
        return list(self.timelines)

    async def policy_state(self) -> dict:
        """What the adaptive policy has learned on this replica, per drafter (services.policy.describe)."""
        return {drafter: describe(costs, self.acceptance.get(drafter)) for drafter, costs in self.costs.items()}

    def _verify_call(self, request_id: str, draft_ids, draft_probs=None, tree_parents=None) -> VerifyCall:
        """A verify call for the batcher; a session's first after a local prefill counts its prompt rows too."""
        return VerifyCall(request_id, list(draft_ids), draft_probs, tree_parents=tuple(tree_parents) if tree_parents else None,
                          prompt_rows=self._prompt_rows.pop(request_id, 0))

    async def _verify_pass(self, calls: list[VerifyCall | ChainedCall]) -> list:
        """One target pass; with chained calls (a local drafter's steps), their proposals in one draft pass right
        before it, on the engine thread (services.chained)."""
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
        """``_Stage._gone``, and what the replica holds for the session beside the engine: its first call's prompt
        rows, a loop that no ``speculate`` call came for (a caller lost in between: cancelled when the session
        closes or is reaped)."""
        super()._gone(request_id)
        self._prompt_rows.pop(request_id, None)
        if (running := self._loops.pop(request_id, None)) is not None:
            running.task.cancel()


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _replica_lost(cause: BaseException) -> bool:
    """A draft call failed because its replica is gone or restarted, not because it is full."""
    return isinstance(cause, (SessionNotFoundError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


async def _awaited(response):
    return await response
