"""Adaptive speculation: pick k for every verify step, 0 (no drafting) included, from one cost model.

With per-position conditional acceptance a_1 .. a_k, a step that drafts k
tokens emits on average

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k          tokens

and costs, as the driver measures it (seconds, moving averages),

    T(k) = verify(k + 1) + [k > 0] propose(k) + overhead

(a request that drafts trees of width w, services.tree: verify(k + w) over
the chain and the first depth's w - 1 side nodes, and a_1 is the acceptance
of any of the first depth's w candidates)

where ``propose`` includes whatever the driver pays to reach the drafter (a
Ray call in the graph, nothing in-process) and ``overhead`` is what every
step pays besides the stage calls (the driver's own work, sending the tokens
to the client): it dilutes the relative cost of drafting, so leaving it out
would turn speculation down where it pays. The policy takes the k in
0 .. k_max with the most tokens per second, E(k) / T(k); speculating must
beat k = 0 by ``margin`` (so that measurement noise does not make the default
slower than speculation off). While it sits at k = 0 it probes k = 1 after
``probe_every`` steps, so a request whose text turns predictable gets
speculation back; a probe that does not doubles the wait (up to
MAX_PROBE_EVERY), so on text where speculation does not pay probes cost little; while it speculates it tries one k above its choice as
often when that k was never measured (unmeasured costs are extrapolated from
the nearest measured ones, pessimistically). A request's acceptance starts
from the driver's estimate over earlier requests (``AcceptanceCounts`` with a
prior weight). Drivers keep one ``CostModel`` per drafter and feed it only
proposals that followed a proposal (after k = 0 steps a proposal also
catches the drafter up, which is not what a step of k costs).

Under load the verifier batches the sessions' rows into one pass, and a
draft row that is rejected takes room from another session's token: with
more than ``max_load`` requests in flight the policy drafts nothing (the
rule of vLLM's ``disable_by_batch_size``; SmartSpec, arXiv 2406.14066,
derives it from goodput). ``splitspec bench load`` measured where it pays.

``RequestGate`` makes the same choice once per request, before it starts:
where speculation has not paid on earlier requests (or under load), a
request runs without a draft session at all, as with speculation off, and
only every few such requests speculate to keep the estimates fresh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services import drafters
from services.tree import tree_rows

EMA_WEIGHT = 0.2  # weight of a new measurement in the moving averages
OUTLIER_CAP = 2.0  # a measurement counts as at most this many times the current average
VERIFY_GROWTH = 0.2  # prior: each extra token scored costs 20% of a one-token pass (CPU, small models)
PRIOR_RATE = 0.5  # acceptance assumed at a position nobody has measured
PRIOR_WEIGHT = 8.0  # how many steps the prior counts for, against a request's own
DEFAULT_MAX_DRAFT_TOKENS = 4
DEFAULT_MARGIN = 0.05
DEFAULT_PROBE_EVERY = 16
MAX_PROBE_EVERY = 128  # probes that do not turn speculation back on back off, doubling up to this
DEFAULT_EXPLORE_EVERY = 8  # of the requests declined on cost, every this many speculates anyway (RequestGate)
DECLINED_COST, DECLINED_LOAD = "cost", "load"  # why RequestGate declined a request


@dataclass
class AcceptanceCounts:
    """Per draft position j: steps that drafted at least j + 1 tokens, and of those, accepted position j."""

    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, n_drafted: int, n_matches: int) -> None:
        while len(self.reached) < n_drafted:
            self.reached.append(0)
            self.accepted.append(0)
        for j in range(n_drafted):
            self.reached[j] += 1
            self.accepted[j] += int(j < n_matches)

    def at(self, j: int) -> tuple[int, int]:
        """(accepted, reached) at position j."""
        return (self.accepted[j], self.reached[j]) if j < len(self.reached) else (0, 0)

    def rate(self, j: int, prior: "AcceptanceCounts | None" = None) -> float:
        """Conditional acceptance at position j, shrunk toward the prior's without these counts (itself toward PRIOR_RATE)."""
        accepted, reached = self.at(j)
        prior_rate = PRIOR_RATE
        if prior is not None:
            prior_accepted, prior_reached = prior.at(j)
            others_accepted, others_reached = max(prior_accepted - accepted, 0), max(prior_reached - reached, 0)
            prior_rate = (others_accepted + PRIOR_WEIGHT * PRIOR_RATE) / (others_reached + PRIOR_WEIGHT)
        return (accepted + PRIOR_WEIGHT * prior_rate) / (reached + PRIOR_WEIGHT)


@dataclass
class CostModel:
    """Moving averages of what a driver measured: verify passes by tokens scored, proposals by k."""

    verify_s: dict[int, float] = field(default_factory=dict)
    propose_s: dict[int, float] = field(default_factory=dict)
    overhead_s: float = 0.0  # per step, beyond the stage calls
    min_propose_s: dict[int, float] = field(default_factory=dict)  # the fastest proposal of each k (a benchmark's ideal)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        _ema(self.verify_s, tokens, seconds)

    def observe_propose(self, k: int, seconds: float) -> None:
        _ema(self.propose_s, k, seconds)
        self.min_propose_s[k] = min(seconds, self.min_propose_s.get(k, seconds))

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_s = max(0.0, _moving_average(self.overhead_s or None, seconds))

    def verify(self, tokens: int) -> float | None:
        return _extrapolate(self.verify_s, tokens, lambda n: 1 + VERIFY_GROWTH * (n - 1))

    def propose(self, k: int) -> float | None:
        return _extrapolate(self.propose_s, k, lambda m: m)  # hop + k draft tokens: linear in k is pessimistic for k > near

    def step(self, k: int, rows: int | None = None) -> float | None:
        """T(k): seconds of a step that drafts k tokens (a tree of k levels: ``rows`` in its verify pass)."""
        verify = self.verify(rows or k + 1)
        if verify is None:
            return None
        if k == 0:
            return verify + self.overhead_s
        propose = self.propose(k)
        return None if propose is None else verify + propose + self.overhead_s


def expected_tokens(rates: list[float]) -> list[float]:
    """E(k) for k = 0 .. len(rates) from conditional acceptance rates a_1 .. a_K."""
    out, reach, total = [1.0], 1.0, 1.0
    for a in rates:
        reach *= a
        total += reach
        out.append(total)
    return out


@dataclass
class AdaptiveK:
    """One request's choice of k, step by step (the driver calls ``choose`` before and ``observe`` after a step)."""

    costs: CostModel  # the driver's, shared across its requests
    prior: AcceptanceCounts | None = None  # the driver's acceptance over earlier requests of this drafter
    k_max: int = DEFAULT_MAX_DRAFT_TOKENS
    margin: float = DEFAULT_MARGIN
    probe_every: int = DEFAULT_PROBE_EVERY
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    steps_without_drafting: int = 0
    steps_since_explore: int = 0
    probe_interval: int = 0  # steps at k = 0 before the next probe (starts at probe_every)
    load: Callable[[], int] | None = None  # requests the driver is serving now, this one included
    max_load: int = 0  # above this load, k = 0: the verifier batches sessions' rows instead (0 = no limit)
    width: int = 1  # the request drafts trees of this width (services.tree): a step of k verifies tree_rows(k, width)

    def __post_init__(self):
        self.probe_interval = self.probe_interval or self.probe_every

    def choose(self, remaining: int) -> int:
        """k for the next step (at most ``remaining - 1``: the step's own token is always emitted)."""
        k_max = min(self.k_max, remaining - 1)
        if k_max <= 0 or self.overloaded:
            return 0
        if self.costs.step(1) is None:  # nothing measured yet: speculate once to learn the costs
            return 1
        best = self._best(k_max)
        if best > 0:
            self.probe_interval = self.probe_every
            self.steps_since_explore += 1
            unmeasured = best + 1 <= k_max and best + 1 not in self.costs.propose_s
            if unmeasured and self.steps_since_explore >= self.probe_every:
                self.steps_since_explore = 0
                return best + 1  # its cost is only extrapolated: measure it
            return best
        if self.steps_without_drafting + 1 >= self.probe_interval:
            self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_EVERY)
            return 1  # probe: the text may have turned predictable
        return 0

    def _best(self, k_max: int) -> int:
        """The k in 0 .. k_max with the most tokens per second, E(k) / T(k); k > 0 must beat k = 0 by ``margin``."""
        gains = expected_tokens([self.counts.rate(j, self.prior) for j in range(k_max)])
        rate = {k: gains[k] / t for k in range(k_max + 1) if (t := self._step(k)) is not None}
        best = max(rate, key=rate.get)
        return best if best > 0 and rate[best] >= rate[0] * (1 + self.margin) else 0

    def would_speculate(self) -> bool:
        """Whether a request's first step would draft (without probing): not overloaded, and the costs and the
        acceptance measured so far say speculation pays, or nothing has been measured yet."""
        if self.overloaded:
            return False
        return self.costs.step(1) is None or self._best(self.k_max) > 0

    def _step(self, k: int) -> float | None:
        return self.costs.step(k, tree_rows(k, self.width))

    @property
    def overloaded(self) -> bool:
        """Serving more than ``max_load`` requests: a batched pass over every session's one pending token emits more
        tokens per second in all than passes that also score drafts (vLLM's disable-by-batch-size)."""
        return bool(self.max_load) and self.load is not None and self.load() > self.max_load

    def choose_hidden(self) -> int:
        """k >= 1 for a block drafted while the verifier runs (pre-drafting): its drafting costs no time, so only
        E(k) / verify(k + 1) counts."""
        gains = expected_tokens([self.counts.rate(j, self.prior) for j in range(self.k_max)])
        rate = {k: gains[k] / t for k in range(1, self.k_max + 1) if (t := self.costs.verify(k + 1)) is not None}
        return max(rate, key=rate.get) if rate else 1

    def observe(self, n_drafted: int, n_matches: int) -> None:
        self.counts.add(n_drafted, n_matches)
        if self.prior is not None:
            self.prior.add(n_drafted, n_matches)
        self.steps_without_drafting = 0 if n_drafted else self.steps_without_drafting + 1


@dataclass
class RequestGate:
    """Per drafter: whether an adaptive request opens a draft session at all.

    While the policy sits at k = 0 a request still pays for speculation being
    possible: a draft session, the target's features at prefill and in every
    verdict, probes. Where the costs and the acceptance measured over earlier
    requests say speculation does not pay (``AdaptiveK.would_speculate``), or
    the ingress is overloaded, a request is served as with speculation off —
    the same path, the same cost. Every ``explore_every``-th request it
    declines on cost speculates anyway, so that the estimates follow a change
    of prompts or of load on the hardware.
    """

    explore_every: int = DEFAULT_EXPLORE_EVERY
    declined: int = 0  # requests declined on cost since the last one that speculated

    def decline(self, policy: AdaptiveK) -> str:
        """Why a request starting now should not speculate (DECLINED_LOAD or DECLINED_COST), or "" if it should."""
        if policy.overloaded:
            return DECLINED_LOAD
        if policy.would_speculate() or self.declined + 1 >= self.explore_every:
            self.declined = 0
            return ""
        self.declined += 1
        return DECLINED_COST


@dataclass(frozen=True)
class RequestPolicy:
    """How one request's loop drafts: decided in one place (``decide``), run by every driver."""

    drafter: str  # the drafter kind; "" = the target alone
    num_draft_tokens: int  # k, or the largest k when ``adaptive``
    adaptive: bool  # k picked per step (AdaptiveK)
    tree_width: int = 1  # > 1: each step drafts a tree (greedy only: services.tree)
    overlap: bool = False  # pre-drafting: the next block drafted while this one is verified (services.loop)
    guesses: int = 0  # likely verdicts a pre-draft drafts a block after (the kind's pre_draft_guesses)

    @property
    def reads_features(self) -> bool:
        return drafters.reads_features(self.drafter)


def decide(drafter: str, num_draft_tokens: int, *, adaptive: bool, greedy: bool, tree_width: int = 1,
           overlap: bool | None = None, remote: bool = False) -> RequestPolicy:
    """A request's policy: ``drafter`` "" runs the target alone. Pre-drafting (``overlap``; None: wherever it can)
    needs a drafter that runs beside the verifier, not on its engine thread (``remote``); trees are for greedy
    requests that do not pre-draft (a pre-draft guesses verdicts on a chain)."""
    if not drafter:
        return RequestPolicy("", 0, False)
    overlap = remote and (overlap is None or overlap)
    return RequestPolicy(drafter, num_draft_tokens, adaptive, tree_width if greedy and not overlap else 1, overlap,
                         drafters.get(drafter).pre_draft_guesses if overlap else 0)


def adaptive_k(policy: RequestPolicy, costs: CostModel, acceptance: AcceptanceCounts, *,
               load: Callable[[], int] | None = None, max_load: int = 0) -> AdaptiveK | None:
    """The request's AdaptiveK on its driver's measured costs and its drafter's acceptance; None for a pinned k."""
    if not (policy.drafter and policy.adaptive):
        return None
    return AdaptiveK(costs, acceptance, k_max=policy.num_draft_tokens, load=load, max_load=max_load,
                     width=policy.tree_width)


def describe(costs: CostModel, counts: AcceptanceCounts | None) -> dict:
    """What a driver's policy has learned for one drafter: step costs (ms) and acceptance by position."""
    return {
        "verify_ms": {n: round(s * 1000, 2) for n, s in sorted(costs.verify_s.items())},
        "propose_ms": {k: round(s * 1000, 2) for k, s in sorted(costs.propose_s.items())},
        "min_propose_ms": {k: round(s * 1000, 3) for k, s in sorted(costs.min_propose_s.items())},
        "overhead_ms": round(costs.overhead_s * 1000, 2),
        "acceptance_by_position": [round(counts.rate(j), 3) for j in range(len(counts.reached))] if counts else [],
    }


def _extrapolate(averages: dict[int, float], key: int, scale) -> float | None:
    """The average at ``key``, else the nearest measured one rescaled by scale(key) / scale(near); None if none."""
    if key in averages:
        return averages[key]
    if not averages:
        return None
    near = min(averages, key=lambda m: abs(m - key))
    return averages[near] * scale(key) / scale(near)


def _ema(averages: dict[int, float], key: int, value: float) -> None:
    averages[key] = _capped_average(averages.get(key), value)


def _capped_average(old: float | None, value: float) -> float:
    """Moving average; one slow call (a pause, another process's burst) counts as at most OUTLIER_CAP x the average."""
    return _moving_average(old, value if old is None else min(value, OUTLIER_CAP * old))


def _moving_average(old: float | None, value: float) -> float:
    return value if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * value
