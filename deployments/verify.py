"""The Verify deployment: verify sessions of the target, each running its request's speculative loop next to the
target and its KV — the one served driver (services.loop's SpeculativeLoop).

``Verify.open`` (by reference: the prefill's KV handoff) opens a request's session and starts its loop in a task of
its own; ``Verify.speculate`` (by value) streams the loop's steps to the ingress. Proposals come from the replica's
own drafter or from the draft stage (deployments.drafting, speculation.drafting); verify calls of concurrent
sessions share batched target passes (deployments.batching).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from deployments import calls
from deployments.drafting import LOCAL, REMOTE, Drafting, LocalDrafting, RemoteDrafting
from deployments.metrics import SessionMetrics
from deployments.stages import KVHandoff, SessionOpened, _identity, _Stage, load_drafter, load_target
from deployments.status import DRAFT_FAILURES, replica_lost, unwrap
from services.chained import ChainedCall, run_chained
from services.draft import DraftEngine
from services.errors import SessionNotFoundError
from services.loop import Results, SpeculativeLoop, StepOutput, execute_async
from services.policy import (
    DECLINED_LOAD, AcceptanceCounts, AdaptiveK, CostModel, RequestGate, RequestPolicy, adaptive_k, decide, describe,
)
from services.resume import resume_from
from services.runner import warm_up
from services.sampling import SamplingParams
from services.verify import VerifyCall, VerifyEngine

logger = logging.getLogger(__name__)

RECENT_TIMELINES = 16  # loops whose timelines a verify replica keeps (``Verify.recent_timelines``)


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
        drafting: Drafting | None = None
        back: asyncio.Task | None = None  # after a lost draft replica: True once a draft replica answers
        emitted: list[int] = []

        def draft_failed(exc: BaseException, when: str) -> None:
            nonlocal back
            cause = unwrap(exc)
            if not isinstance(cause, DRAFT_FAILURES + (asyncio.TimeoutError,)):
                raise exc
            outputs.put_nowait(DraftFallback(when, type(cause).__name__))
            if isinstance(drafting, RemoteDrafting) and replica_lost(cause) and back is None:
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
            first_token, first_logprob = handoff.first_token, handoff.first_logprob
            if first_token is None:  # the prompt's last positions: the session's first step computes them
                await self.faults.point("verify")
                first = await self.batcher.submit(self._verify_call(request_id, []))
                (first_token,), first_logprob = first.token_ids, (first.logprobs or [None])[0]
            del handoff  # (the prefill's KV and features are held by the sessions now)
            adaptive = self._adaptive_k(policy) if drafting is not None else None
            loop = SpeculativeLoop(first_token, max_new_tokens=spec.max_new_tokens, eos=set(spec.eos),
                                   num_draft_tokens=policy.num_draft_tokens, drafting=drafting is not None,
                                   policy=adaptive, overlap=policy.overlap, guesses=policy.guesses,
                                   tree_width=policy.tree_width, chained=isinstance(drafting, LocalDrafting),
                                   costs=self.costs[policy.drafter] if drafting is not None else None,
                                   first_logprob=first_logprob,
                                   grammar=self.engine.grammars.start(params.constraint) if spec.drafter else None)
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
        resume = resume_from(spec.prompt_ids, params, spec.max_new_tokens, emitted)
        ids, params = resume.ids, resume.params
        try:
            handoff = None
            if policy.reads_features:
                handoff = await calls.within(self.prefill.prefill.remote(ids, params, True),
                                            self.config.limits.stage_timeout_s)
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
            results, mask_s = await self._run(lambda: (self.engine.verify_batch(calls), self.engine.mask_s))
        else:
            results, mask_s = await self._run(lambda: (run_chained(self.drafts, self.engine, calls), self.engine.mask_s))
            self.draft_passes += 1
            self.draft_largest_pass = max(self.draft_largest_pass, len(proposals))
            self.draft_metrics.batched_pass(len(proposals), sum(p.rows for p in proposals))
        if mask_s is not None:  # (the target pass's: run_chained's verify_batch sets it too)
            self.session_metrics.grammar_masks(mask_s)
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
