"""splitspec's Prometheus metrics, all in one place (exported with ``ray.serve.metrics``).

Ray prefixes every name with ``ray_`` and adds the ``application``,
``deployment`` and ``replica`` tags; each node's metrics agent serves them
(Prometheus finds the agents through the file Ray writes at
``/tmp/ray/prom_metrics_service_discovery.json``). As in vLLM, events are
counters, latencies are histograms, and ratios are computed in PromQL:

    acceptance rate (accepted / drafted draft tokens):
        sum(rate(ray_splitspec_accepted_tokens_total[1m])) / sum(rate(ray_splitspec_draft_tokens_total[1m]))
    mean acceptance length (tokens emitted per draft-and-verify step, bonus token included):
        (sum(rate(ray_splitspec_accepted_tokens_total[1m])) + sum(rate(ray_splitspec_drafted_steps_total[1m])))
          / sum(rate(ray_splitspec_drafted_steps_total[1m]))
    pre-draft hit rate (steps whose next block was drafted during verification):
        sum(rate(ray_splitspec_pre_draft_hits_total[1m])) / sum(rate(ray_splitspec_pre_drafts_total[1m]))
    acceptance by draft position p (share of verify steps whose draft token p was accepted):
        sum by (position) (rate(ray_splitspec_accepted_tokens_by_position_total[1m]))
          / ignoring(position) group_left sum(rate(ray_splitspec_drafted_steps_total[1m]))
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from ray.serve.metrics import Counter, Gauge, Histogram

# Latency buckets in seconds: 1 ms .. 60 s.
LATENCY_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# Tokens emitted per verify step: 1 (nothing accepted) .. MAX_DRAFT_TOKENS + 1.
ACCEPTED_LENGTH = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 17]
# Calls / rows per batched engine pass.
BATCH_SIZE = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]

# name -> (kind, description, tag keys); the dashboards may use exactly these (tests check both ways).
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "splitspec_requests": ("counter", "Requests finished, by method (a gRPC RPC, or ChatCompletions / Completions of "
                           "the OpenAI API) and outcome (ok or a gRPC status name).", ("method", "outcome")),
    "splitspec_prompt_tokens": ("counter", "Prompt tokens of requests that started generating.", ()),
    "splitspec_generated_tokens": ("counter", "Tokens sent to clients.", ()),
    "splitspec_verify_steps": ("counter", "Verify steps (target forward passes after prefill).", ()),
    "splitspec_drafted_steps": ("counter", "Verify steps that checked at least one draft token (drafts).", ()),
    "splitspec_draft_tokens": ("counter", "Draft tokens proposed and verified.", ()),
    "splitspec_accepted_tokens": ("counter", "Draft tokens the target accepted.", ()),
    "splitspec_accepted_tokens_by_position": ("counter", "Accepted draft tokens by position in the draft (0 = first).", ("position",)),
    "splitspec_pre_drafts": ("counter", "Verify steps that overlapped a pre-draft (overlap on).", ()),
    "splitspec_pre_draft_hits": ("counter", "Pre-drafts whose guess was right: the next block was ready with the verdict.", ()),
    "splitspec_prefills": ("counter", "Prompts prefilled, by stage: prefill, or verify where the prefix cache held all but "
                           "a few positions (limits.local_prefill_tokens) and the verify replica computed them.", ("stage",)),
    "splitspec_kv_handoff_bytes": ("counter", "Bytes of prefill KV handed to verifiers through the object store.", ()),
    "splitspec_drafter_fallbacks": ("counter", "Requests whose speculation was turned off because the draft stage failed.", ("reason",)),
    "splitspec_recoveries": ("counter", "Stage replicas a request lost (killed, OOM, node gone) and recovered from, by stage: "
                             "prefill / verify retried or reopened on a live replica, draft resumed.", ("stage",)),
    "splitspec_speculation_declined": ("counter", "Adaptive requests served without a drafter, by reason: speculation had not "
                                       "paid on earlier requests (cost) or the ingress was overloaded (load).", ("reason",)),
    "splitspec_time_to_first_token_seconds": ("histogram", "Request received -> first token ready.", ()),
    "splitspec_inter_token_latency_seconds": ("histogram", "Time between consecutive tokens sent to a client (per token).", ()),
    "splitspec_request_latency_seconds": ("histogram", "Request received -> last token ready.", ()),
    "splitspec_stage_latency_seconds": ("histogram", "One stage call seen from the ingress, by stage (prefill, draft, verify).", ("stage",)),
    "splitspec_kv_handoff_latency_seconds": ("histogram", "Prefill puts the KV -> the verifier has resolved it.", ()),
    "splitspec_accepted_length": ("histogram", "Tokens emitted per verify step (accepted drafts + recovered or bonus).", ()),
    "splitspec_open_sessions": ("gauge", "Sessions open on this draft / verify replica.", ("stage",)),
    "splitspec_kv_bytes_held": ("gauge", "KV bytes held by this draft / verify replica.", ("stage",)),
    "splitspec_batch_calls": ("histogram", "Calls of concurrent requests batched into one engine pass, by stage (prefill, draft, verify).", ("stage",)),
    "splitspec_batch_rows": ("histogram", "Rows (tokens) of one batched engine pass, by stage.", ("stage",)),
    "splitspec_grammar_mask_seconds": ("histogram", "Seconds computing the grammar masks of one verify pass's constrained "
                                       "sessions (structured outputs), in a thread beside the target's pass; passes "
                                       "without a constrained session are not observed.", ()),
}
BUCKETS = {"splitspec_accepted_length": ACCEPTED_LENGTH, "splitspec_batch_calls": BATCH_SIZE, "splitspec_batch_rows": BATCH_SIZE}


class Metrics:
    """The metric objects one replica records (create inside the replica: Serve adds its tags there)."""

    def __init__(self, names: Iterable[str]):
        self._m = {}
        for name in names:
            kind, description, tags = METRICS[name]
            if kind == "counter":
                self._m[name] = Counter(name, description=description, tag_keys=tags)
            elif kind == "gauge":
                self._m[name] = Gauge(name, description=description, tag_keys=tags)
            else:
                buckets = BUCKETS.get(name, LATENCY_S)
                self._m[name] = Histogram(name, description=description, boundaries=buckets, tag_keys=tags)

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value:
            self._m[name].inc(value, tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._m[name].observe(value, tags=tags or None)

    def set(self, name: str, value: float, **tags: str) -> None:
        self._m[name].set(value, tags=tags or None)


SESSION_GAUGES = ("splitspec_open_sessions", "splitspec_kv_bytes_held")
BATCH_HISTOGRAMS = ("splitspec_batch_calls", "splitspec_batch_rows", "splitspec_grammar_mask_seconds")
REPLICA_METRICS = SESSION_GAUGES + BATCH_HISTOGRAMS  # recorded by the stage replicas, not the ingress


class RequestMetrics:
    """What the ingress records for each request, step and stage call (every metric but the session gauges)."""

    def __init__(self):
        self.m = Metrics(name for name in METRICS if name not in REPLICA_METRICS)
        self.outcomes: collections.Counter[str] = collections.Counter()  # "<method> <outcome>" -> requests (the ingress's stats(), tests)

    def started(self, prompt_tokens: int) -> None:
        self.m.inc("splitspec_prompt_tokens", prompt_tokens)

    def first_chunk(self, ttft_s: float, tokens: int) -> None:
        self.m.observe("splitspec_time_to_first_token_seconds", ttft_s)
        self.m.inc("splitspec_generated_tokens", tokens)

    def verify_step(self, *, sent: int, since_last_s: float, drafted: int, accepted: list[bool], n_matches: int) -> None:
        """One verify step: ``sent`` tokens reached the client ``since_last_s`` after the previous ones."""
        self.m.inc("splitspec_generated_tokens", sent)
        for _ in range(sent):  # the step's tokens arrive together: spread the interval over them
            self.m.observe("splitspec_inter_token_latency_seconds", since_last_s / sent)
        self.m.inc("splitspec_verify_steps")
        if drafted:
            self.m.inc("splitspec_drafted_steps")
            self.m.inc("splitspec_draft_tokens", drafted)
            self.m.inc("splitspec_accepted_tokens", n_matches)
            self.m.observe("splitspec_accepted_length", n_matches + 1)
            for position, ok in enumerate(accepted):
                if ok:
                    self.m.inc("splitspec_accepted_tokens_by_position", position=str(position))

    def pre_drafts(self, pre_drafts: int, hits: int) -> None:
        """A request's pre-drafts and hits (counted when it ends)."""
        if pre_drafts:
            self.m.inc("splitspec_pre_drafts", pre_drafts)
            self.m.inc("splitspec_pre_draft_hits", hits)

    def stage_call(self, stage: str, seconds: float) -> None:
        self.m.observe("splitspec_stage_latency_seconds", seconds, stage=stage)

    def prefilled(self, stage: str) -> None:
        self.m.inc("splitspec_prefills", stage=stage)

    def kv_handoff(self, nbytes: int, seconds: float) -> None:
        self.m.inc("splitspec_kv_handoff_bytes", nbytes)
        self.m.observe("splitspec_kv_handoff_latency_seconds", seconds)

    def fallback(self, reason: str) -> None:
        self.m.inc("splitspec_drafter_fallbacks", reason=reason)

    def recovery(self, stage: str) -> None:
        self.m.inc("splitspec_recoveries", stage=stage)

    def declined(self, reason: str) -> None:
        self.m.inc("splitspec_speculation_declined", reason=reason)

    def finished(self, method: str, outcome: str, latency_s: float | None = None) -> None:
        self.m.inc("splitspec_requests", method=method, outcome=outcome)
        self.outcomes[f"{method} {outcome}"] += 1
        if latency_s is not None:
            self.m.observe("splitspec_request_latency_seconds", latency_s)


class SessionMetrics:
    """Open sessions and KV bytes of one draft / verify replica, and the size of its batched passes."""

    def __init__(self, stage: str):
        self.stage = stage
        self.m = Metrics(REPLICA_METRICS)

    def batched_pass(self, calls: int, rows: int) -> None:
        self.m.observe("splitspec_batch_calls", calls, stage=self.stage)
        self.m.observe("splitspec_batch_rows", rows, stage=self.stage)

    def grammar_masks(self, seconds: float) -> None:
        """A verify pass's grammar masks (VerifyEngine.mask_s)."""
        self.m.observe("splitspec_grammar_mask_seconds", seconds)

    def update(self, sessions: int, kv_bytes: int) -> None:
        self.m.set("splitspec_open_sessions", sessions, stage=self.stage)
        self.m.set("splitspec_kv_bytes_held", kv_bytes, stage=self.stage)
