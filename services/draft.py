"""Draft: per-session proposers (a small draft model, an EAGLE head over the target's features, or prompt lookup).

Interface of a draft session (as transformers' candidate generators):
``propose(k, forced)`` -> draft token ids and their draft distributions q,
``accept(n, next_token, features)`` -> keep the first n proposed tokens plus
the target's next token and roll the draft KV back to that prefix
(``features``: the target's, of the accepted positions, for the EAGLE drafter).

``forced`` are tokens taken as drafted without sampling them: the block the
verifier is checking while the drafter already drafts beyond it (pre-drafting,
services.loop). They head the session's proposal, so a verdict on them is an
ordinary ``accept``. ``pre_draft(k, forced, guesses)`` drafts one block of k
tokens per likely verdict on ``forced`` (a ``Branch``): the whole of it
accepted and the target's next token one of the drafter's top guesses, or its
first token rejected and replaced by one of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from services import draft_vocab
from services.draft_vocab import DraftVocab
from services.drafters import (
    DRAFT_STREAM, EAGLE_DRAFTER, MODEL_DRAFTER, PROMPT_LOOKUP_DRAFTER, Branch, DraftProposal, DrafterKind, branch_keys,
    check_accept, drive, register,
)
from services import drafters
from services.constraint import DraftGrammar, Grammars, exhausted
from services.errors import InvalidRequestError
from services.models import eagle
from services.loading import LoadedModel
from services.prompt_lookup import find_candidates
from services.runner import make_runner
from services.sampling import SamplingParams, logits_to_probs, make_generator, sample
from services.sessions import DEFAULT_MAX_KV_BYTES, DEFAULT_MAX_SESSIONS, SessionStore
from services.tree import MAX_TREE_WIDTH, chain_length, chain_parents, side_ids, with_sides
from services.validation import MAX_DRAFT_TOKENS, validate_num_draft_tokens, validate_prompt

MAX_GUESSES = 8  # verdicts pre_draft may draft a block for, per side (accepted / rejected)
TOKEN_BYTES = 8  # bookkeeping size of a token id in a prompt-lookup session


@dataclass
class Forward:
    """A forward pass a draft-model session asks for: its uncached tokens against its KV; logits of the last row."""

    input_ids: torch.Tensor  # [n]
    cache: object


@dataclass
class ProposeCall:
    """One session's ``propose`` in a batched draft pass (DraftEngine.propose_batch)."""

    request_id: str
    k: int
    forced: Sequence[int] = ()
    guesses: int = 0
    accepts: Sequence[tuple] = ()  # the verdicts since the last proposal: (n_matches, next_token, features)
    width: int = 1  # > 1: a draft tree, the chain and width - 1 side nodes at its first depth (greedy only; services.tree)
    jump: int = 0  # at most this many tokens a constrained request's grammar forces after the chain are added (jump_forward)

    @property
    def rows(self) -> int:
        """Draft tokens it asks for (ContinuousBatcher's budget)."""
        return max(1, self.k) * max(1, self.guesses)


@dataclass
class ModelDraftSession:
    """A draft model's view of one sequence."""

    runner: object  # ModelRunner or FastLlamaRunner
    tokens: list[int]  # accepted context: prompt + accepted tokens
    params: SamplingParams
    generator: torch.Generator
    cache: object  # KVCache or DenseKVCache
    proposal: list[int] = field(default_factory=list)
    grammar: DraftGrammar = field(default_factory=lambda: DraftGrammar(None))  # a constrained request's

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def propose(self, k: int, forced: Sequence[int] = ()) -> DraftProposal:
        return self._alone(self.propose_steps(k, forced))

    def propose_steps(self, k: int, forced: Sequence[int] = (), width: int = 1):
        """``propose`` as a generator of ``Forward`` chunks, sent their logits (DraftEngine.propose_batch batches
        several sessions' chunks into one pass); its return value is the proposal (a tree with ``width`` > 1)."""
        # the cache always lags the context by >= 1 token, so there are logits to sample from
        sides = [] if width > 1 and self.params.greedy else None
        uncached = torch.tensor(self.tokens[self.cache.seq_len :] + list(forced))
        with self.grammar.drafting(forced):
            token_ids, probs = yield from self._sample_chain(uncached, k, sides, width)
        self.proposal = list(forced) + token_ids
        if sides:
            tree_ids, parents = with_sides(token_ids, sides)
            return DraftProposal(tree_ids, None, parents=parents)
        return DraftProposal(token_ids, probs)

    def _alone(self, steps):
        """Drive a generator of Forward chunks one forward pass at a time; its result."""
        return drive(steps, lambda chunk: self.runner.forward(chunk.input_ids, chunk.cache, last_only=True))

    def pre_draft(self, k: int, forced: Sequence[int], guesses: int) -> DraftProposal:
        """A block of k after each likely verdict on ``forced`` (rolling the KV back to each branch point)."""
        forced, context_len = list(forced), len(self.tokens)
        uncached = self.tokens[self.cache.seq_len :] + forced
        rows = self.runner.forward(torch.tensor(uncached), self.cache)  # [len(uncached), vocab_size]
        prefix_logits = self.grammar.prefix_masks(rows[len(rows) - len(forced) - 1 :], forced)  # [len(forced) + 1] x [V]
        branches, valid = [], context_len + len(forced)  # rows that still hold the context and forced tokens
        for n, guess in branch_keys(prefix_logits, forced, guesses):  # deepest branch point first
            self.cache.crop(context_len + n)  # the context, forced[:n]; the guess goes next
            valid = min(valid, context_len + n)
            with self.grammar.drafting(forced[:n] + [guess]):
                ids, probs = self._alone(self._sample_chain(torch.tensor([guess]), k))
            branches.append(Branch(n, guess, ids, probs))
        self.cache.crop(valid)
        self.proposal = forced
        return DraftProposal([], None, branches)

    def pre_draft_steps(self, k: int, forced: Sequence[int], guesses: int):
        """``pre_draft``, alone (its branches roll the KV back in turn: no batched pass)."""
        return self.pre_draft(k, forced, guesses)
        yield  # noqa: unreachable - a generator, as the protocol's steps are

    def _sample_chain(self, uncached: torch.Tensor, k: int, sides: list | None = None, width: int = 1):
        """Up to k tokens, each from the logits of a forward pass over the uncached tokens (a generator of Forward),
        masked by a constrained request's grammar along the path (fewer where it allows nothing: after an EOS);
        ``sides`` (greedy): filled with each depth's side nodes (``tree.side_ids``)."""
        token_ids, q_rows = [], []
        for _ in range(k):
            logits = self.grammar.mask((yield Forward(uncached, self.cache)))  # [1, vocab_size]
            if exhausted(logits):
                break
            if self.params.greedy:  # q is one-hot at the argmax: no need to build it
                x = logits.argmax(dim=-1)  # [1]
                if sides is not None:
                    sides.append(side_ids(logits[0], width, int(x[0]), depth=len(token_ids)))
            else:
                q = logits_to_probs(logits, self.params)  # [1, vocab_size]
                x = sample(q, self.generator)  # [1]
                q_rows.append(q[0])
            token_ids.append(int(x[0]))
            self.grammar.push(token_ids[-1:])
            uncached = x
        return token_ids, torch.stack(q_rows) if q_rows else None  # [k', vocab_size]

    def accept(self, n_matches: int, next_token: int, features: torch.Tensor | None = None) -> None:  # features: unused
        accepted = check_accept(self.proposal, n_matches)
        context_len = len(self.tokens)
        self.tokens += accepted + [int(next_token)]
        self.grammar.accept(accepted + [int(next_token)])
        # roll back: keep KV of the context and the accepted drafts only
        self.cache.crop(min(self.cache.seq_len, context_len + n_matches))
        self.proposal = []


@dataclass
class PromptLookupSession:
    """N-gram matching against the prompt and the text so far (no model, no KV)."""

    tokens: list[int]
    proposal: list[int] = field(default_factory=list)
    grammar: DraftGrammar = field(default_factory=lambda: DraftGrammar(None))  # cuts a match at a forbidden token

    @property
    def nbytes(self) -> int:
        return TOKEN_BYTES * len(self.tokens)

    def propose(self, k: int, forced: Sequence[int] = ()) -> DraftProposal:
        found = self.grammar.allowed_prefix(find_candidates(self.tokens + list(forced), k), after=forced)
        self.proposal = list(forced) + found
        return DraftProposal(found, None)

    def pre_draft(self, k: int, forced: Sequence[int], guesses: int) -> DraftProposal:
        """One branch: the n-gram match's next token as the guess, its continuation as the block."""
        found = self.grammar.allowed_prefix(find_candidates(self.tokens + list(forced), k + 1), after=forced)
        self.proposal = list(forced)
        branches = [Branch(len(forced), found[0], found[1:], None)] if found else []
        return DraftProposal([], None, branches)

    def propose_steps(self, k: int, forced: Sequence[int] = (), width: int = 1):  # (no model pass; a chain)
        return self.propose(k, forced)
        yield  # noqa: unreachable - a generator, as the protocol's steps are

    def pre_draft_steps(self, k: int, forced: Sequence[int], guesses: int):
        return self.pre_draft(k, forced, guesses)
        yield  # noqa: unreachable

    def accept(self, n_matches: int, next_token: int, features: torch.Tensor | None = None) -> None:  # features: unused
        verdict = check_accept(self.proposal, n_matches) + [int(next_token)]
        self.tokens += verdict
        self.grammar.accept(verdict)
        self.proposal = []


class DraftEngine:
    """Per-session drafting with a draft model, an EAGLE head and/or prompt lookup.

    The draft model's LM head is pruned to its draft vocabulary (services.draft_vocab)
    when it ships one: ``draft_vocab_size`` None takes the shipped default,
    ``FULL_VOCAB`` (0) keeps the whole head; a drafter without one keeps it too.
    An EAGLE head keeps as many of its own ids (those it was trained on), the
    ones the draft vocabulary ranks highest (``eagle.with_vocabulary``).
    ``weight_storage=torch.bfloat16`` keeps the draft model's and the EAGLE head's float32 matmul weights as
    bfloat16 (fast_llama.Linear): a draft step streams half the bytes. Lossless whatever it changes in the drafts:
    the verifier accepts by the drafter's own q (greedy: the target's argmax).
    """

    def __init__(
        self,
        draft: LoadedModel | None,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
        max_context: int | None = None,
        vocab_size: int | None = None,
        draft_vocab_size: int | None = None,
        vocab: DraftVocab | None = None,  # default: the one in the drafter's folder, if any
        eagle_head=None,  # services.models.eagle.EagleHead: offers the EAGLE drafter
        weight_storage: torch.dtype | None = None,  # the models' matmul weights: torch.bfloat16 = half the bytes a step reads
    ):
        self.draft = draft
        self.kept_ids = None  # [N] ids the drafter's head keeps; None = every id
        self.runner = None
        if draft is not None:
            vocab = vocab or draft_vocab.find(draft.model)
            self.kept_ids = draft_vocab.resolve_kept_ids(vocab, draft_vocab_size, draft.vocab_size)
            self.runner = make_runner(draft, kept_ids=self.kept_ids, weight_storage=weight_storage)
        if eagle_head is not None and self.kept_ids is not None:  # its LM head too keeps as many, ranked the same
            eagle_head = eagle.with_vocabulary(eagle_head, vocab.ranked_ids, len(self.kept_ids))
        self.eagle_head = eagle_head
        if eagle_head is not None:
            eagle.HeadLinears.of(eagle_head, weight_storage)  # (made once, with this storage)
        self.max_context = max_context or (draft.max_context if draft else 2**31 - 1)
        if vocab_size is None and draft is None and eagle_head is not None:
            vocab_size = eagle_head.embed.shape[0]
        self.vocab_size = vocab_size or (draft.vocab_size if draft else 2**31 - 1)
        self.sessions: SessionStore = SessionStore(kind="draft", max_sessions=max_sessions, max_kv_bytes=max_kv_bytes)
        # constrained requests' grammars, for the target's tokenizer (the draft model shares it: loading.check_pair)
        self.grammars = Grammars.of(draft) if draft is not None else Grammars(None, vocab_size=self.vocab_size, eos_token_ids=())
        self.batch_passes = {EAGLE_DRAFTER: 0, MODEL_DRAFTER: 0}  # passes propose_batch ran, by model kind

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafter kinds this engine offers (services.drafters: those whose model or head it holds)."""
        held = {"": True, "model": self.runner is not None, "head": self.eagle_head is not None}
        return tuple(name for name, kind in drafters.kinds().items() if held.get(kind.needs, False))

    def draft_grammar(self, params: SamplingParams) -> DraftGrammar:
        """A new session's grammar, at the prompt's end (unconstrained: a no-op)."""
        return DraftGrammar(self.grammars.start(params.constraint))

    def start(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        drafter: str = MODEL_DRAFTER,
        features: torch.Tensor | None = None,  # [len(prompt), hidden] the prefill's, for a feature drafter
    ) -> None:
        """Open a session of the drafter kind ``drafter`` over the prompt."""
        if drafter not in self.drafters:
            raise InvalidRequestError(f"unknown drafter {drafter!r}; this server offers {list(self.drafters)}")
        params.validate()
        ids = validate_prompt(prompt_ids, max_context=self.max_context, vocab_size=self.vocab_size)
        self.sessions.put(request_id, drafters.get(drafter).start(self, ids, params, features))

    def propose(self, request_id: str, k: int, forced: Sequence[int] = (), guesses: int = 0,
                accepts: Sequence[tuple] = (), width: int = 1, jump: int = 0) -> DraftProposal:
        """Draft k tokens after the accepted context, or after ``forced`` tokens that follow it (taken as drafted);
        with ``guesses``, one block of k per likely verdict on the forced tokens instead (``DraftProposal.branches``).
        ``accepts``: the verdicts since the last proposal, each ``(n_matches, next_token, features)``, accepted first.
        ``width`` > 1: a greedy session's model or EAGLE drafter proposes a draft tree (services.tree; others a chain).
        ``jump``: at most this many tokens a constrained request's grammar forces after the chain follow it (``jump_forward``)."""
        (result,) = self.propose_batch([ProposeCall(request_id, k, forced, guesses, accepts, width, jump)])
        if isinstance(result, Exception):
            raise result
        return result

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[DraftProposal | Exception]:
        """``propose`` for several sessions at once, each result (or typed error) in its call's slot.

        The sessions draft in lockstep: at each step the EAGLE sessions' rows go through the head in one pass
        (eagle.run_rows) and the draft-model sessions' chunks through the draft model in one pass
        (``forward_batch``), so every weight is read once per step for all of them. A session's proposal is the
        one it gets alone (the matmul kernel's rows do not depend on each other; tested). Prompt-lookup sessions
        need no model. A call with bad input fails alone, and so does a second call of one session.
        """
        results: list = [None] * len(calls)
        steps: dict[int, object] = {}  # slot -> the session's drafting, a generator of Rows / Forward
        seen: set[str] = set()
        for slot, call in enumerate(calls):
            try:
                if call.request_id in seen:
                    raise InvalidRequestError(f"two propose calls for session {call.request_id!r} in one pass")
                seen.add(call.request_id)
                session, forced = self._prepare(call)
                if call.guesses:
                    steps[slot] = session.pre_draft_steps(call.k, forced, call.guesses)
                else:
                    steps[slot] = session.propose_steps(call.k, forced, call.width)
            except Exception as exc:  # noqa: BLE001 - this call's error, in its slot
                results[slot] = exc
        self._lockstep(steps, results)
        for slot, call in enumerate(calls):
            if call.jump and not call.guesses and isinstance(results[slot], DraftProposal):
                try:
                    results[slot] = jump_forward(self.sessions.get(call.request_id), results[slot], call.forced, call.jump)
                except Exception as exc:  # noqa: BLE001 - this session's error, in its slot
                    results[slot] = exc
        if calls:
            self.sessions.enforce_limits(keep=calls[-1].request_id)  # the pass's sessions are the most recently used
        return results

    def _prepare(self, call: ProposeCall):
        """Accept the call's verdicts and check its arguments; its session and forced tokens."""
        for n_matches, next_token, features in call.accepts:
            self.accept(call.request_id, n_matches, next_token, features)
        validate_num_draft_tokens(call.k)
        forced = [int(t) for t in call.forced]
        if len(forced) > MAX_DRAFT_TOKENS or any(not 0 <= t < self.vocab_size for t in forced):
            raise InvalidRequestError(f"forced draft tokens must be at most {MAX_DRAFT_TOKENS} ids in [0, {self.vocab_size})")
        if not 0 <= call.guesses <= MAX_GUESSES:
            raise InvalidRequestError(f"guesses must be in [0, {MAX_GUESSES}], got {call.guesses}")
        if not 1 <= call.width <= MAX_TREE_WIDTH or (call.width > 1 and call.guesses):
            raise InvalidRequestError(f"a draft tree's width must be in [1, {MAX_TREE_WIDTH}], and 1 when pre-drafting")
        return self.sessions.get(call.request_id), forced

    def _forward(self, chunks: list[Forward]) -> list[torch.Tensor]:  # -> per chunk [1, vocab_size]
        return self.runner.forward_batch([(c.input_ids, c.cache) for c in chunks], last_only=True)[0]

    def _lockstep(self, steps: dict, results: list) -> None:
        """Run the sessions' drafting generators step by step, each step's requests batched by kind."""
        asked: dict[int, object] = {}

        def advance(slot: int, answer) -> None:
            try:
                asked[slot] = steps[slot].send(answer)
            except StopIteration as done:
                results[slot] = done.value
            except Exception as exc:  # noqa: BLE001 - this session's error, in its slot
                results[slot] = exc

        for slot in steps:
            advance(slot, None)
        while asked:
            now, answers = dict(asked), {}
            asked.clear()
            for kind, request, run in ((EAGLE_DRAFTER, eagle.Rows, eagle.run_rows), (MODEL_DRAFTER, Forward, self._forward)):
                group = {slot: r for slot, r in now.items() if isinstance(r, request)}
                if not group:
                    continue
                self.batch_passes[kind] += 1
                try:
                    answers.update(zip(group, run(list(group.values()))))
                except Exception as exc:  # noqa: BLE001 - the pass failed: each of its sessions gets the error
                    for slot in group:
                        results[slot] = exc
            for slot in now:
                if slot in answers:
                    advance(slot, answers[slot])

    def accept(self, request_id: str, n_matches: int, next_token: int, features: torch.Tensor | None = None) -> None:
        """Roll back to the verdict; ``features`` [n_matches + 1, hidden] feed a feature drafter (ignored by others)."""
        self.sessions.get(request_id).accept(n_matches, next_token, features)

    def close(self, request_id: str) -> None:
        self.sessions.pop(request_id)


def jump_forward(session, proposal: DraftProposal, forced: Sequence[int], limit: int) -> DraftProposal:
    """``proposal`` with up to ``limit`` more tokens after its chain: those a constrained request's grammar forces
    there (SGLang's jump-forward decoding, as drafts: ``DraftGrammar.forced_run``). Most are the only token the
    grammar allows after the ones before, so the target's masked distribution is certain of them: the verifier
    accepts them wherever it accepts the chain before, at any temperature; the last may be the usual token of bytes
    the grammar forces (` "`), verified as any draft. Their q is one-hot (they follow from the chain, whatever the
    drafter's distribution), and they cost no drafter step. The session's ``proposal`` gets them too; a session
    without a grammar (or an unconstrained request's) proposes what it proposed."""
    grammar = getattr(session, "grammar", None)
    if grammar is None or grammar.state is None:
        return proposal
    ids, parents = list(proposal.token_ids), proposal.parents
    n = chain_length(parents) if parents is not None else len(ids)
    if list(session.proposal) != [*forced, *ids[:n]]:
        raise InvalidRequestError("a proposal's chain is not the session's: its grammar's tokens cannot follow it")
    run = grammar.forced_run([*forced, *ids[:n]], min(limit, MAX_DRAFT_TOKENS - len(ids)))
    if not run:
        return proposal
    session.proposal = [*session.proposal, *run]
    probs = proposal.probs  # [len(ids), vocab_size] a sampled chain's q, else None
    if probs is not None:
        one_hot = torch.zeros(len(run), probs.shape[-1], dtype=probs.dtype)  # [len(run), vocab_size]
        one_hot[torch.arange(len(run)), torch.tensor(run)] = 1.0
        probs = torch.cat([probs, one_hot])
    if parents is not None:  # the side nodes after the longer chain: rows past the chain move down by len(run)
        parents = chain_parents(n + len(run)) + [p if p <= n else p + len(run) for p in parents[n:]]
    return replace(proposal, token_ids=[*ids[:n], *run, *ids[n:]], probs=probs, parents=parents, jumped=len(run))


def _start_model(engine: DraftEngine, ids: list[int], params: SamplingParams, features=None) -> ModelDraftSession:
    """A draft model's session: its KV prefilled over the prompt but the last token (propose starts from its logits)."""
    cache = engine.runner.new_cache()
    if len(ids) > 1:
        engine.runner.forward(torch.tensor(ids[:-1]), cache, last_only=True)
    return ModelDraftSession(engine.runner, ids, params, make_generator(params.seed, DRAFT_STREAM), cache,
                             grammar=engine.draft_grammar(params))


register(DrafterKind(MODEL_DRAFTER, _start_model, needs="model"))
register(DrafterKind(PROMPT_LOOKUP_DRAFTER, lambda engine, ids, params, features=None:
                     PromptLookupSession(ids, grammar=engine.draft_grammar(params))))
