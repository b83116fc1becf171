"""The stage deployments' common shell and the Prefill and Draft stages (Verify: deployments/verify.py): thin Ray
Serve shells around the services/ engines.

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
from collections.abc import Callable
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
from services import eagle_draft
from services.draft import DraftEngine, DraftProposal, ProposeCall
from services.loading import DTYPES, LoadedModel, check_device, config_of, load_causal_lm, load_head_parts, set_num_threads
from services.logprobs import TokenLogprob
from services.prefill import PrefillCall, PrefillEngine, PrefillProgress
from services.runner import warm_up
from services.sampling import SamplingParams

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
    first_logprob: TokenLogprob | None = None  # the first token's, where the request asks for logprobs


@dataclass
class SessionOpened:
    replica_id: str  # pin every later call of the session here (deployments.routing.pin)
    node_id: str
    handoff_ms: float = 0.0  # KV put -> resolved by the verifier
    resolved_bytes: int = 0
    drafting: str = ""  # where the request's loop drafts: "local", "remote" (deployments.drafting), "" = it does not
    declined: str = ""  # why an adaptive request runs without a drafter (services.policy.RequestGate), if it does
    overlap: bool = False  # it pre-drafts


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

    async def sessions_of(self, request_id: str) -> list[str]:
        """The ids of this replica's open sessions of request ``request_id`` (its session ids start with it)."""
        return await self._run(self.engine.sessions.ids, f"{request_id}/")

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
                         feature_refs, result.prompt_rest, result.first_logprob)


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
                      guesses: int = 0, width: int = 1, jump: int = 0) -> DraftProposal:
        """Accept the verdicts since the last proposal (each ``(n_matches, next_token, features)``), then draft k tokens
        after ``forced`` ones — with ``guesses``, a block of k per likely verdict on them (the block the verifier is
        checking meanwhile: pre-drafting, services.loop); ``jump``: at most this many tokens a constrained request's
        grammar forces after the chain follow it (services.draft.jump_forward)."""
        await self.faults.point("propose")
        return await self.batcher.submit(ProposeCall(request_id, k, list(forced), guesses, list(accepts), width, jump))

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
