"""Drafter kinds: one protocol, one registry by name.

A drafter kind proposes draft tokens for one sequence at a time, as a
``DraftSession`` that returns a ``DraftProposal``; ``DraftEngine``
(services.draft) holds the sessions of many requests and drafts them in
lockstep. Where the engine runs (beside the target, or in the draft stage)
is the serving graph's business, not the kind's.

A new kind is one module that defines its session and one ``register`` line:

    class RepeatSession:  # propose the last token again
        ...
    register(DrafterKind("repeat", start=lambda engine, ids, params, features: RepeatSession(list(ids))))

The config's ``models.drafter_modules`` names such modules; every replica
imports them (``load_modules``), so config, the API's validation, the CLI and
the benchmarks see the kind by its name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from services.errors import InvalidRequestError
from services.tree import tree_rows

MODEL_DRAFTER = "model"  # a small model with the target's tokenizer
EAGLE_DRAFTER = "eagle"  # a one-layer head over the target's features (services.eagle_draft)
PROMPT_LOOKUP_DRAFTER = "prompt_lookup"  # n-gram matches in the prompt and the text so far
HYBRID_DRAFTER = "hybrid"  # prompt lookup where the text repeats, the EAGLE head elsewhere (services.hybrid_draft)
DRAFT_STREAM = 1  # random stream of draft samples (see sampling.make_generator)
BUILTIN_MODULES = ("services.draft", "services.eagle_draft", "services.hybrid_draft")  # the built-in kinds


@dataclass
class Branch:
    """A block drafted for one verdict on the forced tokens: n_matches of them accepted, then next_token."""

    n_matches: int
    next_token: int
    token_ids: list[int]  # [k'] the block after next_token
    probs: torch.Tensor | None  # [k', vocab_size] q; None = one-hot


@dataclass
class DraftProposal:
    token_ids: list[int]  # [k'] with k' <= k (prompt lookup may find fewer)
    probs: torch.Tensor | None  # [k', vocab_size] draft distributions q; None = one-hot
    branches: list[Branch] = field(default_factory=list)  # pre_draft's, most likely verdict first
    parents: list[int] | None = None  # the tokens as a draft tree (services.tree): the chain, then side nodes
    draft_s: float = 0.0  # seconds of the drafter's pass that drafted it, where it drafts (a timeline's "draft")
    jumped: int = 0  # tokens at the chain's end that the request's grammar forced (services.draft.jump_forward)


def default_kind(available: Sequence[str]) -> str:
    """The kind a request that names none drafts with, of those a drafter folder offers: the hybrid where there is an
    EAGLE head (it drafts with the head, and copies where the text repeats), else the drafter model."""
    return HYBRID_DRAFTER if HYBRID_DRAFTER in available else MODEL_DRAFTER


def guess_order(logits: torch.Tensor, width: int, exclude: int | None = None) -> list[int]:
    """The ``width`` most likely ids of ``logits`` [V] (over the full vocabulary), without ``exclude`` and without
    ids at -inf (a grammar forbids them: services.constraint)."""
    top = torch.topk(logits, min(width + 1, logits.shape[-1])).indices.tolist()
    return [t for t in top if t != exclude and logits[t] > float("-inf")][:width]


def branch_keys(prefix_logits: list[torch.Tensor], forced: list[int], guesses: int) -> list[tuple[int, int]]:
    """(n_matches, next_token) verdicts worth a block: all forced tokens accepted then one of ``guesses`` top ids,
    or (with forced tokens) the first rejected and replaced by one of ``guesses - 1`` others (``prefix_logits[n]``:
    the drafter's logits for the token after forced[:n], masked by a constrained request's grammar there)."""
    keys = [(len(forced), t) for t in guess_order(prefix_logits[len(forced)], guesses)]
    if forced and guesses > 1:
        keys += [(0, t) for t in guess_order(prefix_logits[0], guesses - 1, exclude=forced[0])]
    return keys


def check_accept(proposal: list[int], n_matches: int) -> list[int]:
    """The accepted prefix of a session's last proposal (a verdict's ``n_matches`` checked against it)."""
    if not 0 <= n_matches <= len(proposal):
        raise InvalidRequestError(f"accepted {n_matches} tokens of a proposal of {len(proposal)}")
    return proposal[:n_matches]


def drive(steps, answer):
    """Run a session's drafting steps alone (a generator, as ``DraftSession``'s): send each request it yields
    ``answer(request)``; return its result, the ``DraftProposal``."""
    try:
        request = next(steps)
        while True:
            request = steps.send(answer(request))
    except StopIteration as done:
        return done.value


class DraftSession(Protocol):
    """One sequence's drafter. The steps are generators: each may yield a batched request (``eagle.Rows``,
    ``draft.Forward``) that the engine answers for all sessions in one pass, and returns the ``DraftProposal``.
    A constrained request's session (``SamplingParams.constraint``) proposes only what its grammar allows: it keeps
    ``engine.draft_grammar(params)`` (services.constraint.DraftGrammar) along its path and masks q with it. A
    session that keeps it as ``grammar``, and its last proposal's chain as ``proposal`` (the forced tokens, then the
    chain: what ``accept`` takes the accepted tokens from), gets the tokens the grammar forces after its chain added
    for free (services.draft.jump_forward)."""

    @property
    def nbytes(self) -> int: ...  # bytes it holds (the engine's limits count them)

    def propose_steps(self, k: int, forced: Sequence[int] = (), width: int = 1) -> Generator[Any, Any, Any]:
        """k tokens after the context and ``forced`` (tokens taken as drafted); ``width`` > 1: a draft tree."""

    def pre_draft_steps(self, k: int, forced: Sequence[int], guesses: int) -> Generator[Any, Any, Any]:
        """A block of k after each of the ``guesses`` likeliest verdicts on ``forced`` (pre-drafting)."""

    def accept(self, n_matches: int, next_token: int, features: torch.Tensor | None = None) -> None:
        """The verdict: keep ``n_matches`` proposed tokens, then ``next_token``; ``features`` [n_matches + 1, hidden]
        are the target's, for a kind that reads them."""


@dataclass(frozen=True)
class DrafterKind:
    name: str
    # (engine, prompt ids, sampling parameters, prompt features [len(prompt), hidden] or None) -> the session
    start: Callable[[Any, Sequence[int], Any, torch.Tensor | None], DraftSession]
    needs: str = ""  # what the drafter folder must hold: "model" (a draft model), "head" (an EAGLE head), "" nothing
    reads_features: bool = False  # sessions take the target's features: prefill and verdicts carry them
    pre_draft_guesses: int = 1  # likely verdicts a pre-draft drafts a block after (what it affords in one verify pass)
    verify_rows: Callable[[int, int], int] = tree_rows  # (k, tree width) -> the most rows a step's verify pass takes


_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    if kind.name in _KINDS and _KINDS[kind.name] != kind:
        raise ValueError(f"a drafter kind named {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def load_modules(modules: Sequence[str] = ()) -> None:
    """Import the built-in kinds and ``modules`` (models.drafter_modules), which register theirs."""
    for module in (*BUILTIN_MODULES, *modules):
        importlib.import_module(module)


def kinds() -> dict[str, DrafterKind]:
    load_modules()
    return dict(_KINDS)


def get(name: str) -> DrafterKind:
    found = kinds().get(name)
    if found is None:
        raise InvalidRequestError(f"unknown drafter {name!r}; known kinds: {sorted(_KINDS)}")
    return found


def reads_features(name: str) -> bool:
    return bool(name) and get(name).reads_features
