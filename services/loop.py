"""The speculative-decoding loop, written once: prefill -> (draft -> verify -> accept)*.

``SpeculativeLoop`` is sans-I/O: it decides what each step asks of the draft
and verify stages and reads their answers, but calls nothing itself. A driver
moves the data: ``speculative_decode`` here runs the engines in-process
(benchmarks, ``generate --local``, tests); served, a request's verify replica
runs it next to the target (deployments/verify.py: ``Verify``), executing a
round's calls with ``execute_async``.

    loop = SpeculativeLoop(first_token, ...)
    results = None
    while (item := loop.advance(results)) is not None:
        if isinstance(item, StepOutput): emit(item); results = None
        else: results = execute(item)   # item: Calls -> Results

Pre-drafting (``overlap=True``, PEARL's post-verify, arXiv 2408.11850):
while the verifier checks block i, the drafter already drafts beyond it: a
block after each likely verdict — block i accepted and the target's next token
one of the drafter's top guesses, or block i's first token rejected and
replaced by one of them (SSD / Saguaro's speculation cache, arXiv 2603.03251).
If the verdict is one of these (a *hit*), its block is verified at once;
otherwise (a *miss*) the next step verifies no block, the target decoding one
token, while the drafter drafts from the corrected token. The drafter never waits for a verdict and the
verifier never waits for the drafter. Lossless: a block is verified with the
q it was sampled from, in the context it was drafted for (a hit means that
context is the real one), and whether it is used depends only on the target's
tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from services import drafters
from services.constraint import DraftGrammar
from services.draft import DraftEngine, DraftProposal
from services.drafters import MODEL_DRAFTER
from services.grammar import GrammarState
from services.logprobs import TokenLogprob
from services.policy import AdaptiveK, CostModel, decide
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.tree import chain_length, tree_rows
from services.validation import validate_max_new_tokens, validate_num_draft_tokens, validate_prompt
from services.verify import VerifyEngine, VerifyResult

# tokens a constrained request's grammar forces after a step's drafts that the step adds (services.draft.jump_forward): the
# forced runs of JSON answers are 1-7 tokens (keys, separators)
MAX_JUMP = 8

FINISH_STOP = "stop"  # an end-of-sequence token was generated
FINISH_LENGTH = "length"  # max_new_tokens reached


@dataclass
class StepOutput:
    """Tokens one step emitted (the first step is prefill's first token)."""

    token_ids: list[int]
    n_drafted: int = 0  # draft tokens verified in this step
    n_matches: int = 0  # of which the target accepted
    accepted: list[bool] = field(default_factory=list)  # per draft position
    finish_reason: str | None = None
    pre_drafted: bool = False  # the drafter pre-drafted while this step's block was verified
    pre_draft_hit: bool = False  # and the verdict was one it guessed: its block is the next one
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, the target's (SamplingParams.logprobs)


@dataclass
class SpeculationStats:
    """One request's speculation counts; the one definition of acceptance rate and mean accepted length."""

    steps: int = 0  # verify steps (target forward passes after prefill)
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    pre_drafts: int = 0  # steps whose verification overlapped a pre-draft
    pre_draft_hits: int = 0  # of which the next block was ready when the verdict came

    def add(self, step: StepOutput) -> None:
        self.steps += 1
        self.drafted += step.n_drafted
        self.accepted += step.n_matches
        self.pre_drafts += step.pre_drafted
        self.pre_draft_hits += step.pre_draft_hit
        for position, ok in enumerate(step.accepted):
            if position == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += int(ok)

    def merge(self, other: "SpeculationStats") -> None:
        for step_field in ("steps", "drafted", "accepted", "pre_drafts", "pre_draft_hits"):
            setattr(self, step_field, getattr(self, step_field) + getattr(other, step_field))
        for position, n in enumerate(other.accepted_per_position):
            if position == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += n

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts + the recovered or bonus token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def hit_rate(self) -> float:
        """Pre-drafts whose block was used / pre-drafts."""
        return self.pre_draft_hits / self.pre_drafts if self.pre_drafts else 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    stats: SpeculationStats
    logprobs: list[TokenLogprob] | None = None  # per token, where the request asks for them


# -- what the loop asks of the stages, and what it is told ---------------------------------------


class Accept(NamedTuple):
    """A verdict the drafter has not seen yet: keep n_matches drafts, then next_token."""

    n_matches: int
    next_token: int
    features: torch.Tensor | None = None  # [n_matches + 1, hidden] for a feature drafter


@dataclass
class Propose:
    """Catch the drafter up with ``accepts``, then draft k tokens after ``forced`` (the block under verification)."""

    k: int
    accepts: list[Accept]
    forced: list[int] = field(default_factory=list)
    guesses: int = 0  # > 0: pre-draft, a block of k per likely verdict on ``forced`` (DraftProposal.branches)
    width: int = 1  # > 1: a draft tree of k levels, ``width`` candidates each (services.tree)
    jump: int = 0  # at most this many tokens a constrained request's grammar forces after the chain follow it


@dataclass
class Verify:
    draft_ids: list[int]
    probs: torch.Tensor | None  # [len(draft_ids), vocab_size] q; None = one-hot
    parents: list[int] | None = None  # the drafts as a tree (services.tree); None = a chain


@dataclass
class Calls:
    """The stage calls of one round; when both are set they run concurrently. ``verify_proposal``: the proposal's
    drafts are verified right after it, as one call (``verify`` unset; a drafter next to the target, see
    ``SpeculativeLoop``'s ``chained``)."""

    propose: Propose | None = None
    verify: Verify | None = None
    verify_proposal: bool = False


@dataclass
class Results:
    proposal: DraftProposal | None = None
    verdict: VerifyResult | None = None
    propose_s: float = 0.0  # wall-clock seconds of each call, as the driver saw them
    verify_s: float = 0.0
    draft_failed: bool = False  # the draft stage failed: go on with the target alone (the answer is the same)


class SpeculativeLoop:
    """The decisions of one request's decode loop, free of I/O (see the module docstring)."""

    def __init__(self, first_token: int, *, max_new_tokens: int, eos: set[int], num_draft_tokens: int,
                 drafting: bool, policy: AdaptiveK | None = None, overlap: bool = False, guesses: int = 1,
                 stats: SpeculationStats | None = None, tree_width: int = 1, chained: bool = False,
                 costs: CostModel | None = None, first_logprob: TokenLogprob | None = None,
                 grammar: GrammarState | None = None):
        self.first_token = first_token
        self.first_logprob = first_logprob  # the first token's, where the request asks for logprobs
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.num_draft_tokens = num_draft_tokens  # k, or the largest k when ``policy`` picks it
        self.drafting = drafting  # turned off for good by a draft-stage failure
        self.policy = policy
        # where the step costs are recorded: the policy's own, else ``costs`` (a pinned k's steps, for the driver's
        # record: the policy of later requests, a benchmark's fastest proposal); None = nowhere
        self.costs = policy.costs if policy is not None else costs
        self.overlap = overlap
        self.guesses = guesses  # top guesses of the target's next token that a pre-draft drafts a block after
        self.tree_width = tree_width  # > 1: each step drafts a tree, the chain and width - 1 side nodes a level
        # a step that drafts asks for its proposal and the verification of its drafts in one round
        # (Calls.verify_proposal): where the drafter runs next to the target, one engine call a step instead of two
        self.chained = chained
        # a structured-output request that speculates: its grammar at the answer's start, which the loop follows along
        # the answer. Its steps ask the drafter for the tokens the grammar forces after their drafts (jump); a step
        # that drafts nothing (k = 0, or no drafter: declined, or drafting failed) verifies the tokens it forces itself
        self.grammar = DraftGrammar(grammar) if grammar is not None else None
        self.constrained = grammar is not None
        self.stats = stats if stats is not None else SpeculationStats()  # filled as the loop runs
        self._steps = None
        self._resume = False

    def resume_drafting(self) -> None:
        """Draft again from the next step, after a draft-stage failure turned drafting off: the driver has opened a
        fresh draft session over the prompt and every emitted token but the last (which the drafter continues from)."""
        self._resume = True

    def advance(self, results: Results | None = None) -> StepOutput | Calls | None:
        """The next thing to emit or to call, given the results of the last calls; None once the request is done."""
        if self._steps is None:
            self._steps = self.run()
        try:
            return self._steps.send(results)
        except StopIteration:
            return None

    def run(self) -> Generator[StepOutput | Calls, Results | None, None]:
        accepts = [Accept(0, self.first_token)]  # verdicts the drafter has not seen: it continues from prefill's token
        block, block_probs, parents = [], None, None  # the next block to verify: pre-drafted on a hit; its tree
        first_logprobs = [self.first_logprob] if self.first_logprob is not None else None
        generated, step = 0, StepOutput([self.first_token], logprobs=first_logprobs)
        caught_up = False  # the drafter had seen every verdict but the last at its last proposal (not so at first: the prompt)
        step_start, calls_s = 0.0, None  # when the last step began; seconds of its stage calls (None: not timed)
        while True:
            step, generated = finish_step(step, generated, self.max_new_tokens, self.eos)
            yield step
            if step.finish_reason:
                return
            if self.grammar is not None:
                self.grammar.accept(step.token_ids)
            if self._resume and not self.drafting:  # a fresh draft session: it continues from the last token
                self.drafting, accepts, block, block_probs, caught_up = True, [Accept(0, step.token_ids[-1])], [], None, False
                parents = None
            self._resume = False
            remaining = self.max_new_tokens - generated
            now = time.perf_counter()
            if self.costs is not None and calls_s is not None:  # the last step's wall time beyond its stage calls
                self.costs.observe_overhead(now - step_start - calls_s)
            step_start, calls_s = now, 0.0
            pre_draft, verified, jumped = None, False, 0
            if self.drafting and self.overlap:
                block, block_probs = block[: remaining - 1], block_probs[: remaining - 1] if block_probs is not None else None
                if remaining > 1:  # (at 1, this step's token is the last)
                    # draft a block after each likely verdict on this block, while the verifier checks it
                    k_after = self.policy.choose_hidden() if self.policy is not None else self.num_draft_tokens
                    k_after = min(k_after, max(1, remaining - 2))  # the next step can use at most remaining - 2
                    pre_draft = Propose(k_after, accepts, list(block), self.guesses)
            elif self.drafting:
                k = self._choose_k(remaining)
                block, block_probs, parents = [], None, None
                if k > 0:
                    verified = self.chained
                    # a tree whose side nodes would not fit the remaining tokens (near a full context) steps as a chain
                    width = self.tree_width if tree_rows(k, self.tree_width) <= remaining else 1
                    # (no row past max_new_tokens, side nodes counted)
                    jump = min(MAX_JUMP, remaining - tree_rows(k, width)) if self.constrained else 0
                    results = yield Calls(propose=Propose(k, accepts, width=width, jump=jump),
                                          verify_proposal=verified)
                    calls_s += results.propose_s
                    if results.draft_failed:
                        self.drafting = False
                    else:
                        if caught_up and self.costs is not None:  # otherwise the call also caught the drafter up
                            self.costs.observe_propose(k, results.propose_s)
                        block, block_probs = results.proposal.token_ids, results.proposal.probs
                        parents, jumped = results.proposal.parents, results.proposal.jumped
                        accepts = []
                caught_up = k > 0
            own_jump = 0  # tokens of this step's block the grammar forced where nothing was drafted (jump_forward's)
            if self.grammar is not None and not block and pre_draft is None and not verified and remaining > 1:
                block = self.grammar.forced_run([], min(MAX_JUMP, remaining - 1))
                own_jump = jumped = len(block)
            if not verified:
                results = yield Calls(propose=pre_draft, verify=Verify(block, block_probs, parents))
            calls_s = None if pre_draft is not None else calls_s + results.verify_s  # overlapped calls: not comparable
            verdict = results.verdict
            chain = len(block) if parents is None else chain_length(parents)  # the block's depth
            if self.costs is not None:
                self.costs.observe_verify(len(block) + 1, results.verify_s)
            if self.policy is not None:  # (the drafter's own tokens: its acceptance, not the grammar's certainty)
                self.policy.observe(chain - jumped, min(verdict.n_matches, chain - jumped))
            if results.draft_failed:
                self.drafting = False
            if self.drafting:  # the drafter catches up with this verdict at its next proposal
                if pre_draft is not None:
                    accepts = []
                accepts += drafter_accepts(verdict, chain) if not own_jump else one_by_one(verdict)
            step = StepOutput(verdict.token_ids, len(block), verdict.n_matches, verdict.accepted,
                              logprobs=verdict.logprobs)
            block, block_probs, parents = [], None, None
            if pre_draft is not None and self.drafting:
                step.pre_drafted = True
                branch = next((b for b in results.proposal.branches
                               if (b.n_matches, b.next_token) == (verdict.n_matches, verdict.token_ids[-1])), None)
                if branch is not None:  # the verdict was one the drafter guessed: its block is next
                    step.pre_draft_hit = True
                    block, block_probs = branch.token_ids, branch.probs
            self.stats.add(step)

    def _choose_k(self, remaining: int) -> int:
        if self.policy is not None:
            return self.policy.choose(remaining)
        return min(self.num_draft_tokens, remaining - 1)


def drafter_accepts(verdict: VerifyResult, chain: int) -> list[Accept]:
    """The verdict as the drafter takes it. Its proposal was the chain: a tree's path that leaves the chain after m
    of its tokens is those m, then each node of the path off the chain in place of the next one (one side node, or a
    branch of several: services.hybrid_draft), then the bonus token."""
    path = verdict.path or []
    m = sum(1 for row in path if row <= chain)  # (the path's rows on the chain come first)
    if m == len(path):  # a chain, or a path along the tree's chain
        return [Accept(verdict.n_matches, verdict.token_ids[-1], verdict.features)]
    features, ids = verdict.features, verdict.token_ids  # [n_matches + 1, hidden], [n_matches + 1]
    rows = lambda start, stop: features[start:stop] if features is not None else None  # noqa: E731
    return [Accept(m, ids[m], rows(0, m + 1))] + [Accept(0, ids[j], rows(j, j + 1)) for j in range(m + 1, len(ids))]


def one_by_one(verdict: VerifyResult) -> list[Accept]:
    """A verdict on tokens the drafter did not propose (the grammar's, at a step that drafted nothing), as the
    drafter takes it: each token after the one before, with its row of the target's features."""
    features, ids = verdict.features, verdict.token_ids  # [n_matches + 1, hidden], [n_matches + 1]
    return [Accept(0, token, features[j : j + 1] if features is not None else None) for j, token in enumerate(ids)]


def finish_step(step: StepOutput, generated: int, max_new_tokens: int, eos: set[int]) -> tuple[StepOutput, int]:
    """Cut a step at the first EOS or at the token budget and set its finish reason."""
    tokens = step.token_ids
    for i, token in enumerate(tokens):
        if token in eos:
            tokens, step.finish_reason = tokens[: i + 1], FINISH_STOP
            break
    if generated + len(tokens) >= max_new_tokens:
        tokens = tokens[: max_new_tokens - generated]
        step.finish_reason = step.finish_reason or FINISH_LENGTH
    step.token_ids = tokens
    if step.logprobs is not None:
        step.logprobs = step.logprobs[: len(tokens)]
    return step, generated + len(tokens)


# -- the in-process driver -----------------------------------------------------------------------


def speculative_decode(
    prefill: PrefillEngine,
    draft: DraftEngine | None,
    verify: VerifyEngine,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    num_draft_tokens: int,
    params: SamplingParams,
    drafter: str = MODEL_DRAFTER,
    request_id: str | None = None,
    policy: AdaptiveK | None = None,
    overlap: bool = False,
    guesses: int | None = None,
    stats: SpeculationStats | None = None,
    tree_width: int = 1,
    chained: bool = False,
    local_tokens: int = 0,
) -> Iterator[StepOutput]:
    """Yield each step's new tokens until EOS or ``max_new_tokens``. ``draft=None`` turns speculation off.
    ``local_tokens``: a prompt whose prefix-cache hit leaves at most this many positions has them computed by the
    verify session's first step (``PrefillCall.local_tokens``; the answer is the same).

    ``policy`` picks k for every step (0 included; services.policy) from the costs it measures here; without one,
    k is ``num_draft_tokens`` throughout. With ``overlap`` the drafter pre-drafts in a second thread while the
    target verifies (torch releases the GIL in its kernels), ``guesses`` of the target's next token each (default:
    the drafter kind's ``pre_draft_guesses``). ``stats``, if given, is filled as the loop runs. ``tree_width`` > 1: a
    greedy request drafts trees (services.tree). ``chained``: each drafting step is one round, its proposal and the
    verification of its drafts (as a verify replica with its own drafter runs it); the answer is the same.
    """
    request_id = request_id or uuid.uuid4().hex
    target = prefill.target
    params.validate()
    if draft is not None:
        validate_num_draft_tokens(num_draft_tokens)
    prompt_ids = validate_prompt(prompt_ids, max_context=verify.max_context, vocab_size=target.vocab_size)
    validate_max_new_tokens(max_new_tokens, prompt_len=len(prompt_ids), max_context=verify.max_context)
    features = draft is not None and drafters.reads_features(drafter)  # the drafter reads the target's features
    # 1. prefill the target (and start the draft session over the same prompt)
    result = prefill.prefill(prompt_ids, params, features=features, local_tokens=local_tokens)
    if draft is not None:
        draft.start(request_id, prompt_ids, params, drafter, result.features)
    pool = ThreadPoolExecutor(1, thread_name_prefix="splitspec-draft") if overlap and draft is not None else None
    try:
        # 2. hand the prefill KV to the verifier (and the prompt's last positions, where prefill left them to it:
        #    the session's first step computes them and draws the first token)
        verify.open(request_id, result.payload, result.first_token, params, features=features,
                    prompt_rest=result.prompt_rest)
        first_token, first_logprob = result.first_token, result.first_logprob
        if first_token is None:
            first = verify.verify(request_id, [])
            (first_token,), first_logprob = first.token_ids, (first.logprobs or [None])[0]
        # (the server's rule, services.policy.decide: pre-drafting where the drafter runs beside the verifier — here
        # in a thread of its own — and trees for greedy requests that do not pre-draft)
        decided = decide(drafter if draft is not None else "", num_draft_tokens, adaptive=policy is not None,
                         greedy=params.greedy, tree_width=tree_width, overlap=overlap, remote=overlap)
        loop = SpeculativeLoop(first_token, max_new_tokens=max_new_tokens, eos=target.eos_token_ids,
                               num_draft_tokens=num_draft_tokens, drafting=draft is not None, policy=policy,
                               overlap=decided.overlap, guesses=guesses or decided.guesses, stats=stats,
                               tree_width=decided.tree_width, chained=chained, first_logprob=first_logprob,
                               grammar=verify.grammars.start(params.constraint) if draft is not None else None)
        yield from drive(loop, draft, verify, request_id, pool)
    finally:
        if pool is not None:
            pool.shutdown()
        verify.close(request_id)
        if draft is not None:
            draft.close(request_id)


def drive(loop: SpeculativeLoop, draft: DraftEngine | None, verify: VerifyEngine, request_id: str,
          pool: ThreadPoolExecutor | None = None) -> Iterator[StepOutput]:
    """Run ``loop`` over open draft / verify sessions in this process; with ``pool``, pre-drafts run in its thread."""
    results = None
    while (item := loop.advance(results)) is not None:
        if isinstance(item, StepOutput):
            yield item
            results = None
        else:  # 3.-5. draft, verify, accept
            results = _execute(item, draft, verify, request_id, pool)


def _execute(calls: Calls, draft: DraftEngine, verify: VerifyEngine, request_id: str, pool) -> Results:
    results = Results()
    if calls.verify_proposal:  # one after the other
        proposed = _execute(Calls(propose=calls.propose), draft, verify, request_id, pool)
        p = proposed.proposal
        verified = _execute(Calls(verify=Verify(p.token_ids, p.probs, p.parents)), draft, verify, request_id, pool)
        proposed.verdict, proposed.verify_s = verified.verdict, verified.verify_s
        return proposed

    def propose():
        start = time.perf_counter()
        p = calls.propose
        results.proposal = draft.propose(request_id, p.k, p.forced, p.guesses, p.accepts, p.width, p.jump)
        results.propose_s = time.perf_counter() - start

    drafting = None
    if calls.propose is not None:
        if pool is not None and calls.verify is not None:
            drafting = pool.submit(propose)
        else:
            propose()
    if calls.verify is not None:
        start = time.perf_counter()
        results.verdict = verify.verify(request_id, calls.verify.draft_ids, calls.verify.probs,
                                        tree_parents=calls.verify.parents)
        results.verify_s = time.perf_counter() - start
    if drafting is not None:
        drafting.result()
    return results


async def execute_async(calls: Calls, propose: Callable[[Propose], Awaitable[DraftProposal | None]],
                        verify: Callable[[Verify], Awaitable[VerifyResult]]) -> Results:
    """One round of the loop's stage calls for an asyncio driver (the ingress, the verify replica): both at once when
    both are set, each timed. ``propose`` returns None when the draft stage failed (the loop goes on with the target
    alone); an error of either call is raised once both have ended, so that none outlives its round."""
    results = Results()

    async def proposing():
        start = time.perf_counter()
        results.proposal = await propose(calls.propose)
        results.propose_s = time.perf_counter() - start
        results.draft_failed = results.proposal is None

    async def verifying():
        start = time.perf_counter()
        results.verdict = await verify(calls.verify)
        results.verify_s = time.perf_counter() - start

    outcomes = await asyncio.gather(*([proposing()] if calls.propose else []), *([verifying()] if calls.verify else []),
                                    return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return results


def generate(*args, **kwargs) -> GenerationResult:
    """Run ``speculative_decode`` to the end and collect its tokens and statistics."""
    tokens: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    stats = SpeculationStats()
    finish_reason = FINISH_LENGTH
    for step in speculative_decode(*args, stats=stats, **kwargs):
        tokens += step.token_ids
        if step.logprobs is not None:
            logprobs = (logprobs or []) + step.logprobs
        finish_reason = step.finish_reason or finish_reason
    return GenerationResult(tokens, finish_reason, stats, logprobs)
