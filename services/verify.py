"""Verify: the target checks k draft tokens in one forward pass and rolls back on rejection."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from services.constraint import Grammars, follow, masked, masked_argmax, row_masks
from services.errors import InvalidRequestError
from services.grammar import GrammarState
from services.kv import KVPayload
from services.loading import LoadedModel
from services.logprobs import TokenLogprob, token_logprobs
from services.prefill import FEATURE_DTYPE, draw_first_token, first_token_logprob
from services.runner import make_runner
from services.sampling import (
    SamplingParams, argmax_ids, greedy_verify, logits_to_probs, make_generator, speculative_sample,
)
from services.sessions import DEFAULT_MAX_KV_BYTES, DEFAULT_MAX_SESSIONS, SessionStore
from services.tree import DraftTree, chain_length, chain_parents
from services.validation import MAX_DRAFT_TOKENS

VERIFY_STREAM = 2  # random stream of accept/reject draws (see sampling.make_generator)
# sessions per pass of the batch-invariant forward (services.batch_invariant): a GPU's pass costs about the same for
# 8 x 17 rows as for 17 (bound by memory and launches); on the CPU every row costs
DEFAULT_PASS_SLOTS = {"cuda": 8, "cpu": 1}


@dataclass
class VerifySession:
    cache: object  # KVCache or DenseKVCache: KV of every accepted token except `pending` (and `prompt_rest`)
    pending: int  # last emitted token, not yet in the target's KV; before the first step: the prompt's last token
    params: SamplingParams
    generator: torch.Generator
    features: bool = False  # return the target's features of the accepted positions (feature drafters, EAGLE)
    # opened from a prefix-cache hit with the prompt's last positions left to compute (``VerifyEngine.open``): those
    # before ``pending``; the first step computes them and draws the first token, as prefill would have
    prompt_rest: list[int] = field(default_factory=list)
    prefilling: bool = False  # the first step is still to come (it takes no drafts)
    grammar: GrammarState | None = None  # after every emitted token (pending included): a constrained request's

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def seq_len(self) -> int:
        """Accepted tokens so far, prompt included."""
        return self.cache.seq_len + len(self.prompt_rest) + 1


@dataclass(frozen=True)
class VerifyCall:
    """One session's verify step, as ``VerifyEngine.verify_batch`` takes it."""

    request_id: str
    draft_token_ids: list[int]  # [k]
    draft_probs: torch.Tensor | None = None  # [k, vocab_size]; None = one-hot (greedy or deterministic drafter)
    params: SamplingParams | None = None  # default: the session's; must be what the drafter used
    tree_parents: tuple[int, ...] | None = None  # the drafts as a tree (services.tree; greedy only); None = a chain
    prompt_rows: int = 0  # the session's first step after a local prefill: the prompt positions before pending

    @property
    def rows(self) -> int:
        """Rows this call adds to a target pass: its pending token and its drafts (and what is left of its prompt)."""
        return self.prompt_rows + len(self.draft_token_ids) + 1


@dataclass(frozen=True)
class VerifyResult:
    token_ids: list[int]  # accepted draft tokens + the recovered or bonus token
    n_matches: int  # accepted draft tokens
    accepted: list[bool]  # per draft position
    features: torch.Tensor | None = None  # [n_matches + 1, hidden] bf16: features of the pending token and the accepted drafts
    path: list[int] | None = None  # a tree's accepted rows (services.tree: row i = draft i - 1); None for a chain
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, the target's (SamplingParams.logprobs)


class VerifyEngine:
    """Per-session verification of the target model."""

    def __init__(self, target: LoadedModel, *, max_sessions: int = DEFAULT_MAX_SESSIONS, max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
                 kv_capacity: int | None = None, pass_slots: int | None = None, fast: bool = True):
        """``kv_capacity``: the longest sequence a session holds (default: the target's context); ``pass_slots``:
        sessions one pass of transformers' forward takes (default: ``DEFAULT_PASS_SLOTS`` of the target's device);
        ``fast=False``: transformers' forward even where the compact one runs (the GPU path, on the CPU)."""
        self.target = target
        # batch-invariant: a row's logits are the same in a k + 1-row pass as in a one-row step (greedy exactness)
        self.max_context = min(target.max_context, kv_capacity or target.max_context)
        slots = pass_slots or DEFAULT_PASS_SLOTS.get(target.model.device.type, 1)
        self.runner = make_runner(target, fast=fast, batch_invariant=True, kv_capacity=self.max_context,
                                  pass_slots=slots)
        self.sessions: SessionStore[VerifySession] = SessionStore(
            kind="verify", max_sessions=max_sessions, max_kv_bytes=max_kv_bytes
        )
        self.grammars = Grammars.of(target)  # constrained requests' (SamplingParams.constraint)
        # computes a pass's grammar masks while the target runs it (llguidance and torch both release the GIL)
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="splitspec-masks")
        self.mask_s: float | None = None  # seconds the last pass's masks took (None: no constrained session in it)

    def open(self, request_id: str, payload: KVPayload, first_token: int | None, params: SamplingParams, *,
             features: bool = False, prompt_rest: Sequence[int] = ()) -> None:
        """Start a session from a prefill's KV payload (refused if another model computed it).

        ``features``: each verdict also carries the target's features of the positions it accepts. ``prompt_rest``
        (with ``first_token`` None): the prompt's last positions, which the payload does not hold (a prefill that
        handed them over: ``PrefillCall.local_tokens``); the session's first step computes them in its pass and
        draws the first token from their last row exactly as prefill does (its random stream included), so the
        answer is the one a prefill of the whole prompt gives.
        """
        params.validate()
        if (first_token is None) == (not prompt_rest):
            raise InvalidRequestError("a verify session opens with the first token or with the prompt's rest, one of them")
        if prompt_rest and features:
            raise InvalidRequestError("a session with features opens from a full prefill (its prompt features)")
        cache = self.runner.import_payload(payload)
        generator = make_generator(params.seed, VERIFY_STREAM)
        rest = [int(t) for t in prompt_rest]
        pending = int(first_token) if first_token is not None else rest.pop()
        grammar = self.grammars.start(params.constraint)
        follow(grammar, [first_token] if first_token is not None else [])  # (else the first step draws it)
        self.sessions.put(request_id, VerifySession(cache, pending, params, generator, features, rest, bool(prompt_rest),
                                                    grammar=grammar))

    def verify(
        self,
        request_id: str,
        draft_token_ids: list[int],  # [k]
        draft_probs: torch.Tensor | None = None,  # [k, vocab_size]; None = one-hot (greedy or deterministic drafter)
        params: SamplingParams | None = None,  # default: the session's; must be what the drafter used
        tree_parents: tuple[int, ...] | None = None,  # the drafts as a tree (services.tree); None = a chain
    ) -> VerifyResult:
        """Score ``pending + draft`` in one pass, accept a prefix (a tree: a path), roll back the rest."""
        (result,) = self.verify_batch([VerifyCall(request_id, draft_token_ids, draft_probs, params, tree_parents)])
        if isinstance(result, Exception):
            raise result
        return result

    def verify_batch(self, calls: list[VerifyCall]) -> list[VerifyResult | Exception]:
        """Verify several sessions in one target pass (ragged rows: each its pending token and its own k drafts).

        Each session attends to its own KV and accepts / rejects with its own sampling parameters and random
        stream, so its verdict is the one ``verify`` alone gives. A call with bad input (or an unknown session)
        gets its error in its slot; the others go on.
        """
        results: list[VerifyResult | Exception | None] = [None] * len(calls)
        self.mask_s = None
        checked = []  # (slot, call, session, draft [k], tree or None)
        for slot, call in enumerate(calls):
            try:
                if any(call.request_id == other.request_id for _, other, *_ in checked):
                    raise InvalidRequestError(f"session {call.request_id!r} got two verify calls in one pass")
                checked.append((slot, call, *self._check(call)))
            except Exception as exc:  # typed errors (services.errors) for the caller of that slot
                results[slot] = exc
        if not checked:
            return results
        # 1. one target pass over every session's [pending, d_1 .. d_k] gives its p_1 .. p_{k+1} (a prefilling
        #    session's rows: the rest of its prompt, pending last; only the last row's logits are computed)
        chunks = [(torch.cat([torch.tensor([*session.prompt_rest, session.pending]), draft]), session.cache)
                  for _, _, session, draft, _ in checked]
        starts = [session.cache.seq_len for _, _, session, _, _ in checked]
        trees = [tree for *_, tree in checked]
        # argmax ids, not logits, where greedy verification reads nothing else (a constrained row's: masked_argmax)
        screens = getattr(self.runner, "screens_masked_rows", False)
        greedy = [s.params.argmax_only or (screens and s.params.greedy and s.params.logprobs is None)
                  for _, _, s, _, _ in checked]
        prefilling = [session.prefilling for _, _, session, _, _ in checked]
        # constrained sessions: the grammar's allowed ids at each of their rows, computed beside the pass
        masks = self._masker.submit(self._row_masks, checked) if any(s.grammar is not None for _, _, s, _, _ in checked) else None
        all_logits, all_features = self.runner.forward_batch(  # per session: [k + 1, V] ([k + 1] ids if argmax_only), [k + 1, hidden]
            chunks, greedy=greedy, last_only=prefilling, **({"trees": trees} if any(trees) else {}))
        all_allowed = masks.result() if masks is not None else [None] * len(checked)  # per session [k + 1, V] bool
        for (slot, call, session, draft, tree), start, logits, features, allowed in zip(
                checked, starts, all_logits, all_features, all_allowed):
            try:
                if isinstance(allowed, Exception):
                    raise allowed
                # the target's logits as the grammar allows them (p is masked); argmax ids: of the masked logits
                if allowed is not None and logits.dim() == 1:  # (argmax ids: screens_masked_rows)
                    logits = masked_argmax(logits, allowed, features[-logits.shape[0]:], self.runner)
                else:
                    logits = masked(logits, allowed)
                results[slot] = self._verdict(call, session, draft, tree, start, logits, features)
                follow(session.grammar, results[slot].token_ids)  # a constrained session's: after the emitted tokens
            except Exception as exc:  # noqa: BLE001 - this session's step fails alone; its rows of the pass are dropped
                session.cache.crop(min(start, session.cache.seq_len))
                results[slot] = exc
        for _, call, *_ in checked:
            self.sessions.enforce_limits(keep=call.request_id)
        return results

    def _row_masks(self, checked: list) -> list[torch.Tensor | Exception | None]:
        """Per session, the ids its grammar allows at each row of the pass ([k + 1, V] bool; None: unconstrained): row
        0 after the emitted tokens, row i after the draft path to node i - 1 (a draft the grammar forbids keeps its
        parent's row: p is 0 there, so it is rejected). An error (a malformed tree) is that session's alone. Times
        them all (``mask_s``)."""
        start, out = time.perf_counter(), []
        for _, _, session, draft, tree in checked:
            try:
                parents = tree.parents if tree is not None else chain_parents(len(draft))
                out.append(row_masks(session.grammar, draft.tolist(), parents))
            except Exception as exc:  # noqa: BLE001 - GrammarStateError (bad parents), for that session's slot
                out.append(exc)
        self.mask_s = time.perf_counter() - start
        return out

    def _verdict(self, call: VerifyCall, session: VerifySession, draft: torch.Tensor, tree: DraftTree | None,
                 start: int, logits: torch.Tensor, features: torch.Tensor) -> VerifyResult:
        """One session's verdict from its rows of the pass (``logits``: [k + 1, V], or its argmax ids [k + 1] if
        ``argmax_only``; ``features`` [k + 1, hidden]); its KV then holds pending and the accepted drafts (from
        ``start``). With ``SamplingParams.logprobs`` each emitted token gets its row's (services.logprobs)."""
        # (an argmax_only session's ``logits`` are the argmax ids of its rows [k + 1]: all that greedy verification reads)
        if session.prefilling:
            return self._first_token(session, logits)
        # 2. exact accept / reject (services.sampling); a tree: the target's greedy path through it
        if tree is not None:
            path, bonus = tree.greedy_walk(draft, argmax_ids(logits))
            depth = max(tree.depths())
            session.cache.keep(start, [0] + path)  # pending + the accepted path, in sequence
            session.pending = bonus
            accepted_features = features[[0] + path].to(FEATURE_DTYPE) if session.features else None
            token_ids = [int(draft[r - 1]) for r in path] + [bonus]
            return VerifyResult(token_ids, len(path), [True] * len(path) + [False] * (depth - len(path)),
                                accepted_features, path, self._logprobs(session, logits, [0] + path, token_ids))
        if session.params.greedy:
            result = greedy_verify(draft, argmax_ids(logits))
        else:
            p = logits_to_probs(logits, session.params)  # [k + 1, vocab_size]
            q = call.draft_probs if call.draft_probs is not None else _one_hot(draft, p.shape[-1])  # [k, vocab_size]
            result = speculative_sample(draft, q, p, session.generator)
        # 3. keep KV of pending + accepted drafts; the new pending token is not in the KV yet
        session.cache.crop(start + 1 + result.n_matches)
        session.pending = result.token_ids[-1]
        accepted_features = None
        if session.features:
            accepted_features = features[: 1 + result.n_matches].to(FEATURE_DTYPE)  # [n_matches + 1, hidden]
        rows = list(range(1 + result.n_matches))  # token i follows row i: pending, then each accepted draft
        return VerifyResult(result.token_ids, result.n_matches, result.accepted, accepted_features,
                            logprobs=self._logprobs(session, logits, rows, result.token_ids))

    @staticmethod
    def _logprobs(session: VerifySession, logits: torch.Tensor, rows: list[int],
                  token_ids: list[int]) -> list[TokenLogprob] | None:  # logits [k + 1, V]
        """Each emitted token's logprob from the row it follows, where the request asks for them."""
        if session.params.logprobs is None:
            return None
        return token_logprobs(logits[rows], token_ids, session.params)

    @staticmethod
    def _first_token(session: VerifySession, logits: torch.Tensor) -> VerifyResult:  # [1, V] ([1] id if argmax_only)
        """A prefilling session's first step: the prompt is in the KV now; the first token is drawn from the last
        row as prefill draws it (services.prefill: the argmax, or a sample from its own random stream)."""
        token = draw_first_token(logits, session.params)
        session.pending, session.prompt_rest, session.prefilling = token, [], False
        logprob = first_token_logprob(logits, token, session.params)
        return VerifyResult([token], 0, [], logprobs=[logprob] if logprob is not None else None)

    def _check(self, call: VerifyCall) -> tuple[VerifySession, torch.Tensor, DraftTree | None]:  # draft ids [k]
        session = self.sessions.get(call.request_id)
        k = len(call.draft_token_ids)
        if session.prefilling and k:
            raise InvalidRequestError(f"session {call.request_id!r} has not computed its prompt yet: its first verify "
                                      "call takes no drafts (it draws the first token)")
        if k > MAX_DRAFT_TOKENS:
            raise InvalidRequestError(f"got {k} draft tokens, at most {MAX_DRAFT_TOKENS} are allowed")
        context = self.max_context - session.seq_len
        if k >= context:
            raise InvalidRequestError(f"{k} draft tokens do not fit in the remaining context of {context}")
        draft = torch.tensor(call.draft_token_ids, dtype=torch.long)  # [k]
        if k and not bool(((draft >= 0) & (draft < self.target.vocab_size)).all()):
            raise InvalidRequestError(f"draft token ids must be in [0, {self.target.vocab_size})")
        if call.draft_probs is not None and tuple(call.draft_probs.shape) != (k, self.target.vocab_size):
            raise InvalidRequestError(
                f"draft_probs must be [k, vocab_size] = [{k}, {self.target.vocab_size}], got {list(call.draft_probs.shape)}"
            )
        if call.params is not None:
            session.params = call.params.validate()
        tree = None
        if call.tree_parents is not None:
            tree = DraftTree.checked(call.tree_parents, k)
            if tree.is_chain:
                tree = None
            elif not session.params.greedy:
                raise InvalidRequestError("draft trees are verified greedily: a sampled request drafts a chain")
            elif not getattr(self.runner, "supports_trees", False):
                # transformers' forward (e.g. on a GPU) takes no tree mask here: verify the tree's chain, which is
                # what the drafter's session follows (the side nodes are only extra candidates)
                draft, tree = draft[: chain_length(tree.parents)], None
        return session, draft, tree

    def close(self, request_id: str) -> None:
        self.sessions.pop(request_id)


def _one_hot(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [k] -> [k, vocab_size]
    q = torch.zeros(token_ids.shape[0], vocab_size)
    q[torch.arange(token_ids.shape[0]), token_ids] = 1.0
    return q
