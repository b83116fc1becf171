"""Prefill: run the target over the prompt, sample the first token, export the KV."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.constraint import Grammars, masked, row_masks
from services.errors import SessionNotFoundError
from services.kv import KVPayload
from services.loading import LoadedModel
from services.logprobs import TokenLogprob, token_logprobs
from services.prefix_cache import PrefixCache, PrefixHit
from services.runner import make_runner
from services.sampling import SamplingParams, argmax_ids, logits_to_probs, make_generator, sample
from services.validation import validate_prompt

PREFILL_STREAM = 0  # random stream of the first token (see sampling.make_generator)
FEATURE_DTYPE = torch.bfloat16  # features handed to a drafter (what the EAGLE head was trained on)


@dataclass(frozen=True)
class PrefillCall:
    """One request's prefill, or one chunk of it, as ``PrefillEngine.prefill_batch`` takes it."""

    prompt_ids: list[int]
    params: SamplingParams
    features: bool = False  # also the target's features of every prompt position (feature drafters, EAGLE)
    request_id: str = ""  # one call per request in a pass; names a chunked prefill's partial KV between chunks
    start: int = 0  # prompt positions already prefilled by earlier chunks
    chunk: int = 0  # at most this many positions in this call (0 = the rest of the prompt)
    local_tokens: int = 0  # a prefix-cache hit that leaves at most this many positions: hand them to the verifier

    @property
    def rows(self) -> int:
        left = len(self.prompt_ids) - self.start
        return min(left, self.chunk) if self.chunk else left


@dataclass(frozen=True)
class PrefillProgress:
    """A chunk of a long prompt is done; the next call continues at ``done``."""

    done: int


@dataclass
class PrefillResult:
    first_token: int | None  # sampled from the target's distribution after the prompt; None: see prompt_rest
    payload: KVPayload  # KV of the prompt positions, to hand to a verifier
    features: torch.Tensor | None = None  # [n, hidden] bf16 target features of the prompt (feature drafters, EAGLE)
    # the prompt's last positions, not computed here (``PrefillCall.local_tokens``): the payload holds the KV before
    # them, and the verifier computes them in its session's first step, which draws the first token
    prompt_rest: list[int] = field(default_factory=list)
    first_logprob: TokenLogprob | None = None  # the first token's (``SamplingParams.logprobs``; services.logprobs)


def draw_first_token(logits: torch.Tensor, params: SamplingParams) -> int:  # [1, vocab_size] ([1] argmax id if argmax_only)
    """The token after the prompt, from the logits of its last position: the argmax, or a sample drawn from the
    request's own random stream for it (``PREFILL_STREAM``)."""
    if params.greedy:
        return int(argmax_ids(logits)[0])
    probs = logits_to_probs(logits, params)  # [1, vocab_size]
    return int(sample(probs, make_generator(params.seed, PREFILL_STREAM))[0])


def first_token_logprob(logits: torch.Tensor, token: int, params: SamplingParams) -> TokenLogprob | None:  # [1, V]
    """The first token's logprob where the request asks for logprobs (then ``logits`` are logits, not ids)."""
    return token_logprobs(logits, [token], params)[0] if params.logprobs is not None else None


class PrefillEngine:
    """Prefill of the target model: stateless, but for the KV of a long prompt between its chunks."""

    def __init__(self, target: LoadedModel, *, prefix_cache_bytes: int = 0):
        self.target = target
        self.runner = make_runner(target)
        self.grammars = Grammars.of(target)  # constrained requests' (SamplingParams.constraint)
        self._partial: dict[str, tuple[object, list[torch.Tensor]]] = {}  # request id -> (KV, features) between chunks
        # recent prompts' KV, reused by prompts that start like them (services.prefix_cache); 0 bytes: off
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.local_prefills = 0  # prompts whose last positions went to the verifier (``PrefillCall.local_tokens``)

    def prefill(self, prompt_ids: Sequence[int], params: SamplingParams, *, features: bool = False,
                local_tokens: int = 0) -> PrefillResult:
        """Prefill the prompt; ``features`` also returns the target's features of every prompt position;
        ``local_tokens``: see ``PrefillCall``."""
        (result,) = self.prefill_batch([PrefillCall(list(prompt_ids), params, features, local_tokens=local_tokens)])
        if isinstance(result, Exception):
            raise result
        return result

    def prefill_batch(self, calls: list[PrefillCall]) -> list[PrefillResult | PrefillProgress | Exception]:
        """Several prompts (or chunks of long ones) in one target pass: ragged rows, each prompt its own KV.

        A prompt with bad input gets its error in its slot; the others go on. Each first token is drawn with its
        own parameters and seed. A chunk that does not end its prompt keeps the prompt's KV here (under its
        ``request_id``) and returns ``PrefillProgress``; the call with the last chunk returns the result. A prompt
        that starts like a recent one takes that prefix's KV from the prefix cache and computes only the rest —
        or, if the rest is at most ``local_tokens`` positions (and no features are asked for), computes nothing:
        its result hands the cached prefix's KV and the rest (``prompt_rest``) to the verifier, whose batched pass
        takes those few rows at little cost where a pass here reads every weight for them (conditional
        disaggregation).
        """
        results: list[PrefillResult | PrefillProgress | Exception | None] = [None] * len(calls)
        checked = []  # (slot, call, ids [rows], cache, features so far)
        for slot, call in enumerate(calls):
            try:
                if call.start == 0:
                    call.params.validate()
                    if call.params.constraint is not None:  # a bad schema fails before any pass
                        self.grammars.compile(call.params.constraint)
                    validate_prompt(call.prompt_ids, max_context=self.target.max_context, vocab_size=self.target.vocab_size)
                    hit = self._lookup(call)
                    if hit is not None and not call.features and len(call.prompt_ids) - hit.length <= call.local_tokens:
                        # (no pass: the cached prefix's KV as it is, in arrays of its own for the object store)
                        results[slot] = PrefillResult(None, hit.payload.compact(), prompt_rest=list(call.prompt_ids[hit.length:]))
                        self.local_prefills += 1
                        continue
                    cache, feats, cached = self._begin(call, hit)
                    call = dataclasses.replace(call, start=cached)  # a prefix-cache hit: go on after it
                else:
                    cache, feats = self._partial.pop(call.request_id)
                ids = call.prompt_ids[call.start : call.start + call.rows]
                checked.append((slot, call, ids, cache, feats))
            except KeyError:
                results[slot] = SessionNotFoundError(f"prefill {call.request_id!r} has no earlier chunks here")
            except Exception as exc:  # typed errors (services.errors) for the caller of that slot
                results[slot] = exc
        if not checked:
            return results
        all_logits, all_features = self.runner.forward_batch(
            [(torch.tensor(ids), cache) for _, _, ids, cache, _ in checked], last_only=True,
            greedy=[call.params.argmax_only for _, call, *_ in checked],
        )  # per prompt: [1, vocab_size] ([1] argmax id if argmax_only), [rows, hidden]
        for (slot, call, ids, cache, feats), logits, chunk_features in zip(checked, all_logits, all_features):
            try:
                results[slot] = self._after_pass(call, ids, cache, feats, logits, chunk_features)
            except Exception as exc:  # noqa: BLE001 - this prompt's step fails alone
                self._partial.pop(call.request_id, None)
                results[slot] = exc
        return results

    def _after_pass(self, call: PrefillCall, ids: list[int], cache, feats: list[torch.Tensor], logits: torch.Tensor,
                    chunk_features: torch.Tensor) -> PrefillResult | PrefillProgress:
        """One prompt's outcome of a pass over its chunk ``ids``: its progress, or its first token and KV."""
        if call.features:
            feats.append(chunk_features.to(FEATURE_DTYPE))
        done = call.start + len(ids)
        if done < len(call.prompt_ids):
            self._partial[call.request_id] = (cache, feats)
            return PrefillProgress(done)
        # (a constrained request's first token comes from the row masked by its grammar after its prefix)
        logits = masked(logits, row_masks(self.grammars.start(call.params.constraint), [], []))  # [1, V]
        first_token = draw_first_token(logits, call.params)
        result = PrefillResult(
            first_token=first_token,
            payload=cache.export(self.target.fingerprint),
            features=torch.cat(feats) if call.features else None,  # [n, hidden]
            first_logprob=first_token_logprob(logits, first_token, call.params),
        )
        if self.prefix_cache is not None:
            self.prefix_cache.insert(call.prompt_ids, result.payload, result.features)
        return result

    def _lookup(self, call: PrefillCall) -> PrefixHit | None:
        """The longest prefix of the prompt the prefix cache holds (with features if the call asks for them)."""
        return self.prefix_cache.lookup(call.prompt_ids, features=call.features) if self.prefix_cache is not None else None

    def _begin(self, call: PrefillCall, hit: PrefixHit | None) -> tuple[object, list[torch.Tensor], int]:
        """A new prompt's KV, features so far and first position to compute: from the prefix cache's ``hit`` on the
        prompt's opening, else empty."""
        if hit is None:
            return self.runner.new_cache(), [], 0
        return self.runner.import_payload(hit.payload), [hit.features] if call.features else [], hit.length

    def drop(self, request_id: str) -> None:
        """Forget a chunked prefill that will not continue (its request failed or went away)."""
        self._partial.pop(request_id, None)
