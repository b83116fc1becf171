"""A request's constraint (structured outputs), and the grammar states that follow it through the stages.

The constraint travels in ``SamplingParams.constraint``, as the temperature does: prefill, the verify session and
the draft session each compile it for the target's tokenizer (``Grammars``: one compiler per model, the grammars
cached by schema text) and keep a ``GrammarState`` of their own along the tokens they draw or propose. Every
distribution a token comes from is masked by that state first: prefill's first token, the target's p at each row
of a verify pass (the chain's or the tree's paths: ``GrammarState.tree_masks``), the drafter's q at each position of
its path (``DraftGrammar``). Rejection sampling then runs on the masked p and q, and greedy output is the
constrained target's, token for token (services.grammar says why).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from services.errors import InvalidGrammarError, InvalidRequestError
from services.grammar import Grammar, GrammarCompiler, GrammarState, mask_logits, unpack_bitmask

MAX_SCHEMA_CHARS = 64 * 1024  # a longer schema is refused before it is compiled (compiling is linear in its size)


@dataclass(frozen=True)
class Constraint:
    """The JSON schema a request's answer follows."""

    json_schema: str  # the schema's text (grammar.JSON_OBJECT_SCHEMA: any JSON object)
    # tokens of the answer emitted before the context's end: a session opened again after a lost replica holds them in
    # its prompt (services.resume), and its grammar starts after them
    prefix: tuple[int, ...] = ()

    def validate(self) -> Constraint:
        """InvalidGrammarError if the schema is not a string of a sane size (compiling it checks the rest)."""
        if not isinstance(self.json_schema, str) or not self.json_schema.strip():
            raise InvalidGrammarError("json_schema must be a JSON schema as a non-empty string")
        if len(self.json_schema) > MAX_SCHEMA_CHARS:
            raise InvalidGrammarError(f"json_schema has {len(self.json_schema)} characters, at most {MAX_SCHEMA_CHARS} are allowed")
        return self

    def after(self, tokens: Sequence[int]) -> Constraint:
        """The constraint of a context that also holds ``tokens`` of the answer."""
        return replace(self, prefix=self.prefix + tuple(int(t) for t in tokens))


class Grammars:
    """One model's grammars: its compiler is built at the first constrained request (under a second for 49k ids),
    each schema compiled once (``GrammarCompiler`` caches them). Thread-safe."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model) -> Grammars:  # a services.loading.LoadedModel
        return cls(model.tokenizer, vocab_size=model.vocab_size, eos_token_ids=model.eos_token_ids)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer; this model has none")
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, vocab_size=self._vocab_size, eos_token_ids=self._eos)
            return self._compiler

    def compile(self, constraint: Constraint) -> Grammar:
        """The constraint's grammar; InvalidGrammarError (llguidance's reason) if the schema cannot be compiled."""
        return self.compiler.json_schema(constraint.validate().json_schema)

    def start(self, constraint: Constraint | None) -> GrammarState | None:
        """A state after the constraint's prefix; None for an unconstrained request."""
        if constraint is None:
            return None
        state = self.compile(constraint).start()
        state.advance_many(constraint.prefix)
        return state


def row_masks(state: GrammarState | None, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor | None:
    """Allowed ids [1 + n, V] (bool) of a verify pass's rows: row 0 after the state's tokens, row i after the path to
    draft node i - 1 (``tokens`` / ``parents``: services.tree's layout); None if unconstrained."""
    if state is None:
        return None
    return unpack_bitmask(state.tree_masks(tokens, parents), state.compiler.vocab_size)


def masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:  # [n, V], [n, V] bool -> [n, V]
    """The logits with -inf where the grammar forbids (as they are if unconstrained)."""
    return logits if allowed is None else mask_logits(logits, allowed)


# a forbidden row whose grammar allows at most this many ids takes their logits alone (``head_logits_at``), not the
# full head's: at a JSON object's punctuation and keys, where the model's own argmax is most often forbidden, it is 1-2
FEW_ALLOWED = 64


def masked_argmax(ids: torch.Tensor, allowed: torch.Tensor | None, features: torch.Tensor, runner) -> torch.Tensor:
    """The argmax of each row's masked logits, from its argmax ``ids`` [n] (``FastLlamaRunner.argmax``'s screen,
    cheaper than the logits): a row whose argmax the grammar allows (``allowed`` [n, V] bool) keeps it (the masked
    argmax is then the same id); a row whose grammar allows one id takes it; the others take the argmax of their
    allowed ids' logits (the runner's ``head_logits_at(features [1, hidden], ids [a] ascending) -> [1, a]``, the bits
    of the full head's) where they are few, of their masked ``head_logits`` [m, V], in one call, elsewhere. Ties go to
    the lowest id, as ``argmax`` of the masked logits gives them. A pass over a constrained greedy session costs its
    neighbours no full logits where the grammar agrees with the model or leaves it a few ids."""
    if allowed is None:
        return ids
    forbidden = ~allowed[torch.arange(ids.shape[0]), ids]  # [n]
    if not bool(forbidden.any()):
        return ids
    ids = ids.clone()
    many = []  # forbidden rows whose grammar allows more than FEW_ALLOWED ids: one head call for them all
    for row in forbidden.nonzero().flatten().tolist():
        allowed_ids = allowed[row].nonzero().flatten()  # [a] ascending
        if allowed_ids.numel() == 1:
            ids[row] = allowed_ids[0]
        elif allowed_ids.numel() <= FEW_ALLOWED:
            ids[row] = allowed_ids[runner.head_logits_at(features[row:row + 1], allowed_ids)[0].argmax()]
        else:
            many.append(row)
    if many:
        ids[many] = mask_logits(runner.head_logits(features[many]), allowed[many]).argmax(-1)
    return ids


def follow(state: GrammarState | None, token_ids: Iterable[int]) -> None:
    """Advance over emitted tokens, up to the first EOS (the answer ends there; a bonus row after it is only EOS)."""
    if state is None:
        return
    for token in token_ids:
        if state.ended:
            return
        state.advance(int(token))


def exhausted(logits: torch.Tensor) -> bool:
    """No id is left to propose (every logit -inf: after an EOS, or no allowed id in a pruned vocabulary)."""
    return bool(torch.isneginf(logits).all())


class DraftGrammar:
    """A draft session's grammar: at the accepted context between proposals, and down the path being drafted while
    it proposes (``push``, ``pop``, ``unwind``). The drafter masks each position's logits with ``mask`` before it
    samples or takes the argmax (its q is then the masked distribution), stops where nothing is left
    (``exhausted``), and cuts a deterministic proposal at the first id the mask forbids (``allowed_prefix``).
    ``state`` None: an unconstrained request, where every method changes nothing."""

    def __init__(self, state: GrammarState | None):
        self.state = state
        self.depth = 0  # tokens pushed past the accepted context

    def mask(self, logits: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` [..., n] with -inf where the path's next token may not be; ``ids`` [n]: the vocabulary ids the
        last dimension holds (a pruned head's kept ids), default all of them."""
        if self.state is None:
            return logits
        if self.state.ended:
            return torch.full_like(logits, float("-inf"))
        allowed = self.state.allowed()  # [V]
        return mask_logits(logits, allowed if ids is None else allowed[ids])

    def push(self, tokens: Iterable[int]) -> None:
        for token in tokens if self.state is not None else ():
            self.state.advance(int(token))
            self.depth += 1

    def pop(self, n: int) -> None:
        if self.state is not None:
            self.state.rollback(n)
            self.depth -= n

    def unwind(self) -> None:
        """Back to the accepted context."""
        self.pop(self.depth)

    @contextlib.contextmanager
    def drafting(self, tokens: Iterable[int]):
        """Draft after ``tokens`` (forced, or a branch's prefix) within the block; back to the accepted context after
        it, whatever the block pushed."""
        self.push(tokens)
        try:
            yield
        finally:
            self.unwind()

    def prefix_masks(self, rows: Iterable[torch.Tensor], forced: Sequence[int]) -> list[torch.Tensor]:
        """``rows[n]`` (the logits [V] of the token after ``forced[:n]``, n = 0 .. len(forced)) masked by the grammar
        after ``forced[:n]`` (pre-drafting's branch points); the path is back at the accepted context afterwards."""
        with self.drafting(()):
            out = []
            for n, logits in enumerate(rows):
                out.append(self.mask(logits))
                self.push(forced[n : n + 1])
            return out

    def allowed_prefix(self, tokens: Sequence[int], after: Sequence[int] = ()) -> list[int]:
        """``tokens`` up to the first the mask forbids after the path and ``after`` (the path is the same afterwards)."""
        if self.state is None:
            return list(tokens)
        self.push(after)
        n = 0
        while n < len(tokens) and not self.state.ended and self.state.accepts(int(tokens[n])):
            self.push([tokens[n]])
            n += 1
        self.pop(n + len(after))
        return list(tokens[:n])

    def forced_run(self, after: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after the path and ``after``: each the only token it allows
        after the ones before, then the tokens of the bytes it forces where several tokens may cover them (` "`
        before a string's value: likely, not certain). The path is the same afterwards."""
        if self.state is None or limit <= 0:
            return []
        self.push(after)
        run = []
        while len(run) < limit and (token := self.state.forced()) is not None:
            run.append(token)
            self.push([token])
        for token in self.state.forced_bytes_tokens()[: limit - len(run)]:
            if self.state.ended or not self.state.accepts(token):
                break
            run.append(token)
            self.push([token])
        self.pop(len(run) + len(after))
        return run

    def accept(self, token_ids: Sequence[int]) -> None:
        """The verdict's tokens (accepted drafts, then the target's), from the accepted context."""
        self.unwind()
        follow(self.state, token_ids)
