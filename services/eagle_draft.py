"""The EAGLE drafter: a one-layer head over the target's features (services.models.eagle), as a draft session.

A feature drafter needs what a token drafter does not: the target's feature
(final-norm output) of every accepted position. Prefill returns the prompt's
(``PrefillEngine.prefill(features=True)``), each verdict the accepted ones'
(``VerifyEngine.open(features=True)``); the session pairs feature f_t with
the token x_{t+1} once that token is known and extends the head's KV with
them. Drafts are sampled from q = softmax over the head's kept ids (zero
elsewhere), so the verifier's rejection sampling stays exact.

The head lives in the drafter's folder (``eagle_head.safetensors`` with its
``eagle_head.json``), installed by ``splitspec models prepare``; it reads the
target's frozen embeddings, so the draft stage loads them from the target.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.constraint import DraftGrammar, exhausted
from services.draft_vocab import scatter_kept
from services.drafters import (
    DRAFT_STREAM, EAGLE_DRAFTER, Branch, DraftProposal, DrafterKind, branch_keys, check_accept, register,
)
from services.errors import InvalidRequestError
from services.loading import HeadParts, LoadedModel
from services.models import eagle
from services.sampling import SamplingParams, logits_to_probs, make_generator, sample
from services.tree import side_ids, with_sides

logger = logging.getLogger(__name__)

HEAD_FILE = "eagle_head.safetensors"
HEAD_REPORT = "eagle_head.json"  # recipe, measured acceptance and c, and the target it was trained for
IDENTITY_IGNORES = ("dtype", "torch_dtype", "_name_or_path", "transformers_version", "architectures")
# The head reads the last this-many prompt positions. A long prompt cost its first proposal a pass over every position
# (~0.3 s for 1,500 here, about a sixth of a 48-token answer), and acceptance does not need them: on Spec-Bench's
# long-prompt categories the head, trained on short contexts, accepts as much with 128 or 256 (docs/journal/2026-12-07.md).
PROMPT_WINDOW = 256


def find(draft_dir: str | Path | None) -> Path | None:
    """The EAGLE head installed in a drafter folder, or None."""
    if not draft_dir:
        return None
    path = Path(draft_dir) / HEAD_FILE
    return path if path.is_file() else None


def target_identity(config) -> str:
    """Which target a head belongs to: a hash of the target's config (not its dtype, folder name or version fields)."""
    keep = {k: v for k, v in config.to_diff_dict().items() if k not in IDENTITY_IGNORES}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load(path: Path, target: LoadedModel | HeadParts) -> eagle.EagleHead:
    """Load a head for ``target`` (loaded, or the parts a head reads: loading.load_head_parts); a head trained for
    another target is refused with a clear error."""
    report_path = path.with_name(HEAD_REPORT)
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    trained_for, serving = report.get("target"), target_identity(target.config)
    if trained_for and trained_for != serving:
        raise ValueError(f"the EAGLE head {path} was trained for target {trained_for!r}, not this server's {serving!r}")
    head = eagle.load_head(target.model, path)
    if head.cfg.feature != "final":
        raise ValueError(f"the EAGLE head {path} reads {head.cfg.feature!r} features; serving hands over only the final-norm ones")
    if head.feature_dim != head.embed.shape[1]:
        raise ValueError(f"the EAGLE head {path} reads {head.feature_dim}-wide features; the target's are {head.embed.shape[1]}")
    logger.info("EAGLE head from %s: %s features, %d kept ids", path, head.cfg.feature, len(head.kept_ids))
    return head


def installed_head(draft: LoadedModel | None, target: LoadedModel) -> eagle.EagleHead | None:
    """The EAGLE head installed beside a drafter (in its folder), loaded for ``target``; None if there is none."""
    folder = getattr(draft.model, "name_or_path", "") if draft is not None else ""
    path = find(folder)
    return load(path, target) if path else None


@dataclass
class EagleDraftSession:
    """One sequence drafted by an EAGLE head."""

    head: eagle.EagleHead
    vocab_size: int
    tokens: list[int]  # accepted context: prompt + accepted tokens
    params: SamplingParams
    generator: torch.Generator
    unpaired: torch.Tensor  # [m, hidden] features of the last m accepted positions, whose next token is not known yet
    state: eagle.HeadSession | None = None
    next_logits: torch.Tensor | None = None  # [N] the head's logits for the first draft token
    context_g: torch.Tensor | None = None  # [1, h] the feature fed with the first draft token
    proposal: list[int] = field(default_factory=list)
    grammar: DraftGrammar = field(default_factory=lambda: DraftGrammar(None))  # a constrained request's (masks q)
    skipped: int = 0  # prompt positions the head never reads (before its window)

    def __post_init__(self):
        self.state = self.state or eagle.HeadSession(self.head)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.unpaired.nbytes

    def propose(self, k: int, forced: Sequence[int] = ()):
        return eagle.run_alone(self.propose_steps(k, forced))

    def pre_draft(self, k: int, forced: Sequence[int], guesses: int):
        return eagle.run_alone(self.pre_draft_steps(k, forced, guesses))

    def propose_steps(self, k: int, forced: Sequence[int] = (), width: int = 1):
        """``propose`` as a generator: it yields the head's ``Rows`` and is sent their logits, so that a draft
        engine can run several sessions' steps in one pass (eagle.run_rows); its return value is the proposal.
        ``width`` > 1 (greedy): a draft tree, the chain and the first depth's next ``width - 1`` ids (services.tree)."""
        yield from self._catch_up()
        logits = self.next_logits
        self.state.chain_len, self.state.g = 0, self.context_g  # a new chain from the accepted context
        for x in forced:  # through the block being verified, on the head's own predicted features
            logits = yield self.state.chain_rows(x)
        sides = [] if width > 1 and self.params.greedy else None
        with self.grammar.drafting(forced):
            token_ids, probs = yield from self._sample_chain(logits, k, sides, width)
        self.proposal = list(forced) + token_ids
        if sides:
            tree_ids, parents = with_sides(token_ids, sides)
            return DraftProposal(tree_ids, None, parents=parents)
        return DraftProposal(token_ids, probs)  # q: [k, vocab_size]

    def pre_draft_steps(self, k: int, forced: Sequence[int], guesses: int):
        """A block of k after each likely verdict on ``forced``: the chain forks at the branch point's row and feature."""
        yield from self._catch_up()
        kept, state = self.head.kept_ids, self.state
        state.chain_len, state.g = 0, self.context_g
        forks = [(self.next_logits, state.g)]  # per prefix forced[:n]: logits of the next token, the feature fed with it
        for x in forced:
            forks.append(((yield state.chain_rows(x)), state.g))
        prefix_logits = self.grammar.prefix_masks(  # [V] each, masked by the grammar after forced[:n]
            (scatter_kept(logits[None], kept, self.vocab_size)[0] for logits, _ in forks), list(forced))
        branches = []
        for n, guess in sorted(branch_keys(prefix_logits, list(forced), guesses), key=lambda key: -key[0]):
            state.chain_len, state.g = n, forks[n][1]  # rows of forced[:n] stay; deeper forks are done first
            with self.grammar.drafting([*forced[:n], guess]):
                ids, probs = yield from self._sample_chain((yield state.chain_rows(guess)), k)
            branches.append(Branch(n, guess, ids, probs))
        self.proposal = list(forced)
        return DraftProposal([], None, sorted(branches, key=lambda b: -b.n_matches))

    def _sample_chain(self, logits: torch.Tensor, k: int, sides: list | None = None, width: int = 1):
        """Up to k tokens sampled from the chain, starting from ``logits`` [N] over the kept ids (a generator of Rows),
        masked by a constrained request's grammar along the path (fewer where it allows nothing);
        ``sides`` (greedy): filled with each depth's side nodes (``tree.side_ids``)."""
        kept, token_ids, q_rows = self.head.kept_ids, [], []
        for i in range(k):
            logits = self.grammar.mask(logits, kept)  # [N]
            if exhausted(logits):
                break
            if self.params.greedy:
                x = int(kept[logits.argmax()])
                if sides is not None:
                    sides.append([int(kept[j]) for j in side_ids(logits, width, int(logits.argmax()), depth=i)])
            else:
                q = logits_to_probs(scatter_kept(logits[None], kept, self.vocab_size), self.params)  # [1, vocab_size]
                x = int(sample(q, self.generator)[0])
                q_rows.append(q[0])
            token_ids.append(x)
            self.grammar.push([x])
            if i + 1 < k:
                logits = yield self.state.chain_rows(x)
        return token_ids, torch.stack(q_rows) if q_rows else None  # [k', vocab_size]

    def accept(self, n_matches: int, next_token: int, features: torch.Tensor | None = None) -> None:
        """Keep n_matches drafts and the target's token; ``features`` [n_matches + 1, hidden] are the verdict's.

        Only bookkeeping: the head reads the new positions at the next ``propose`` (steps without drafting cost nothing).
        """
        verdict = check_accept(self.proposal, n_matches) + [int(next_token)]
        self.tokens += verdict
        self.grammar.accept(verdict)
        self.proposal = []
        if features is not None:
            if features.shape[0] != n_matches + 1:
                raise InvalidRequestError(f"got features of {features.shape[0]} positions for {n_matches} accepted tokens + 1")
            self.unpaired = torch.cat([self.unpaired, features.to(self.unpaired.dtype)])
        elif self._missing_features() > 0:
            raise InvalidRequestError("the EAGLE drafter needs the target's features of the accepted tokens")
        self.next_logits = None

    def _missing_features(self) -> int:
        """Accepted positions before the last whose feature the session lacks (< 0: it has one whose next token it lacks)."""
        return len(self.tokens) - 1 - (self.skipped + self.state.length + self.unpaired.shape[0])

    def _catch_up(self):
        """Extend the head over the accepted positions it has not read: feature f_t with token x_{t+1} (a generator
        of Rows: nothing when it has read them all)."""
        if self.next_logits is not None:
            return
        m, missing = self.unpaired.shape[0], self._missing_features()
        if missing < 0:  # features of a position whose next token is not known
            raise InvalidRequestError("the EAGLE drafter has not been told the token after the prompt: accept a verdict before proposing")
        if m == 0 or missing > 0:
            raise InvalidRequestError("the EAGLE drafter needs the target's features of every accepted token")
        self.next_logits = yield self.state.extend_rows(self.unpaired, torch.tensor(self.tokens[-m:]))
        self.context_g = self.state.g
        self.unpaired = self.unpaired[:0]


def start_session(head: eagle.EagleHead, vocab_size: int, prompt_ids: Sequence[int], params: SamplingParams,
                  generator: torch.Generator, features: torch.Tensor | None,
                  grammar: DraftGrammar | None = None) -> EagleDraftSession:
    """A session over the prompt; ``features`` [len(prompt), hidden] are the prefill's (the head reads the last
    ``PROMPT_WINDOW``); ``grammar``: a constrained request's (``DraftEngine.draft_grammar``)."""
    if features is None:
        raise InvalidRequestError("the EAGLE drafter needs the prompt's target features (prefill with features=True)")
    if features.shape[0] != len(prompt_ids) or features.shape[1] != head.feature_dim:
        raise InvalidRequestError(
            f"prompt features have shape {tuple(features.shape)}, expected ({len(prompt_ids)}, {head.feature_dim})"
        )
    skipped = max(0, len(prompt_ids) - PROMPT_WINDOW)
    return EagleDraftSession(head, vocab_size, list(prompt_ids), params, generator, features[skipped:].clone(),
                             grammar=grammar or DraftGrammar(None), skipped=skipped)


def start(engine, ids: list[int], params: SamplingParams, features: torch.Tensor | None) -> EagleDraftSession:
    """A session of the engine's head (the kind's ``start``; the hybrid kind wraps it)."""
    vocab_size = engine.eagle_head.embed.shape[0]  # q spans the target's vocabulary, as its verifier's p does
    return start_session(engine.eagle_head, vocab_size, ids, params, make_generator(params.seed, DRAFT_STREAM), features,
                         engine.draft_grammar(params))


# an EAGLE chain step is ~1/8 of a target step: a pre-draft affords a block after each of 3 guesses
register(DrafterKind(EAGLE_DRAFTER, start, needs="head", reads_features=True, pre_draft_guesses=3))
