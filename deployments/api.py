"""The wire format at the edge: splitspec.v1 protos in, a validated ``Plan`` out, and responses back."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from deployments.config import AppConfig
from services.constraint import Constraint, Grammars
from services.drafters import MODEL_DRAFTER, kinds
from services.errors import InvalidRequestError
from services.logprobs import TokenLogprob
from services.loop import FINISH_LENGTH, FINISH_STOP, SpeculationStats, StepOutput
from services.sampling import SamplingParams
from services.text import encode_prompt, validate_stop
from services.validation import validate_max_new_tokens, validate_num_draft_tokens, validate_prompt
from splitspec.api.v1 import splitspec_pb2 as pb

FINISH_STOP_SEQUENCE = "stop_sequence"
FINISH_REASONS = {
    FINISH_STOP: pb.FINISH_REASON_STOP,
    FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
    FINISH_STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}
MAX_REQUEST_ID_CHARS = 256


@dataclass
class Plan:
    """A validated request, in the engine's terms."""

    request_id: str  # the client's, echoed back
    session_id: str  # unique per request: the draft / verify session key
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop: list[str]
    speculate: bool
    num_draft_tokens: int  # k, or the largest k when adaptive
    drafter: str
    adaptive: bool = False  # k picked per step by services.policy
    overlap: bool | None = None  # pre-drafting (services.loop) as asked; once the verify replica decided: whether it does
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    fallback: bool = False  # speculation was turned off mid-request after a draft-stage failure
    declined: bool = False  # adaptive, but served without a drafter (services.policy.RequestGate)

    @property
    def drafting(self) -> bool:
        """The request opens a draft session."""
        return self.speculate and not self.declined


@dataclass
class Answer:
    """A whole answer, as the ingress collects it from the steps' kept tokens and new text."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    logprobs: list[TokenLogprob] | None = None  # per token, where the request asks for them

    def add(self, step: StepOutput, token_ids: list[int], text: str) -> None:
        self.text += text
        self.token_ids += token_ids
        self.finish_reason = step.finish_reason or self.finish_reason
        if step.logprobs is not None:
            self.logprobs = (self.logprobs or []) + step.logprobs


class Timer:
    """One request's server-side timings (pb.Timings)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.ttft_ms = 0.0
        self.prefill_ms = 0.0
        self.kv_handoff_ms = 0.0
        self.last_emit = self.start  # when the last tokens went out (inter-token latency)

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000

    def timings(self) -> pb.Timings:
        return pb.Timings(ttft_ms=self.ttft_ms, total_ms=self.ms(), prefill_ms=self.prefill_ms, kv_handoff_ms=self.kv_handoff_ms)


def parse(request, config: AppConfig, tokenizer, *, max_context: int, vocab_size: int, drafters=None,
          default_drafter: str = MODEL_DRAFTER, grammars: Grammars | None = None) -> Plan:
    """Validate a GenerateRequest / GenerateStreamRequest; raise InvalidRequestError with an actionable message
    (InvalidGrammarError, llguidance's reason, for a ``json_schema`` that ``grammars``, the target's, cannot compile)."""
    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    check_size(request, config)
    messages = [(m.role, m.content) for m in request.messages]
    prompt_ids = validate_prompt(
        encode_prompt(tokenizer, request.prompt, messages), max_context=max_context, vocab_size=vocab_size
    )
    params = SamplingParams(
        temperature=float(request.temperature),
        top_k=int(request.top_k),
        top_p=float(request.top_p) if request.HasField("top_p") else 1.0,
        seed=int(request.seed) if request.HasField("seed") else None,
        logprobs=requested_logprobs(request),
        constraint=Constraint(request.json_schema) if request.json_schema else None,
    ).validate()
    if params.constraint is not None and grammars is not None:  # a bad schema fails here, before any stage works
        grammars.compile(params.constraint)
    max_new_tokens = request.max_new_tokens if request.HasField("max_new_tokens") else config.limits.default_max_new_tokens
    validate_max_new_tokens(
        max_new_tokens, prompt_len=len(prompt_ids), max_context=max_context, limit=config.limits.max_new_tokens
    )
    policy, defaults = request.speculation, config.speculation
    mode = policy.mode
    speculate = defaults.enabled if mode == pb.SpeculationPolicy.MODE_UNSPECIFIED else mode == pb.SpeculationPolicy.MODE_ON
    k = policy.num_draft_tokens or defaults.num_draft_tokens
    adaptive = k == 0  # neither the request nor the config pins k
    if adaptive:
        k = defaults.max_draft_tokens
    if adaptive and speculate and params.seed is not None and params.temperature > 0:
        # an adaptive k (and the request gate) decides which random draws are made: a seeded sampled request gets a
        # pinned k instead, so that its seed reproduces the answer
        adaptive = False
        k = defaults.seeded_draft_tokens or k
        speculate = defaults.seeded_draft_tokens > 0
    validate_num_draft_tokens(int(k))
    drafter = policy.drafter or default_drafter
    drafters = tuple(kinds()) if drafters is None else drafters  # (default: every registered kind)
    if drafter not in drafters:
        raise InvalidRequestError(f"unknown drafter {drafter!r}; this server offers {list(drafters)}")
    return Plan(
        request_id=request_id,
        session_id=f"{request_id}/{uuid.uuid4().hex[:12]}",
        prompt_ids=prompt_ids,
        params=params,
        max_new_tokens=max_new_tokens,
        stop=validate_stop(request.stop, max_chars=config.limits.max_stop_chars),
        speculate=speculate,
        num_draft_tokens=int(k),
        drafter=drafter,
        adaptive=adaptive,
        overlap=policy.overlap if policy.HasField("overlap") else defaults.overlap,
    )


def requested_logprobs(request) -> int | None:
    """``SamplingParams.logprobs`` of a request: None without ``logprobs``, else the alternatives it asks for."""
    if not request.logprobs:
        if request.top_logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: set logprobs to true as well")
        return None
    return int(request.top_logprobs)


def logprobs(entries: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    """The wire form of the emitted tokens' logprobs (none where the request did not ask for them)."""
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top])
            for e in entries or ()]


def check_size(request, config: AppConfig) -> None:
    """Refuse oversized text before any work on it (tokenising a megabyte would hold the ingress' tokenizer)."""
    limits = config.limits
    if len(request.messages) > limits.max_messages:
        raise InvalidRequestError(f"the request has {len(request.messages)} chat messages, the server's limit is "
                                  f"{limits.max_messages}")
    chars = len(request.prompt) + sum(len(m.role) + len(m.content) for m in request.messages)
    if chars > limits.max_prompt_chars:
        raise InvalidRequestError(f"the prompt is {chars} characters, the server's limit is {limits.max_prompt_chars}: "
                                  "shorten the prompt")


def speculation_stats(plan: Plan) -> pb.SpeculationStats:
    s = plan.stats
    return pb.SpeculationStats(
        steps=s.steps,
        drafted=s.drafted,
        accepted=s.accepted,
        accepted_per_position=s.accepted_per_position,
        enabled=plan.speculate,
        drafter=plan.drafter if plan.speculate else "",
        num_draft_tokens=plan.num_draft_tokens if plan.speculate else 0,
        fell_back=plan.fallback,
        adaptive=plan.speculate and plan.adaptive,
        pre_drafts=s.pre_drafts,
        pre_draft_hits=s.pre_draft_hits,
        overlap=plan.speculate and plan.overlap,
        declined=plan.declined,
    )


def usage(plan: Plan, completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(plan.prompt_ids), completion_tokens=completion_tokens)
