"""The hybrid drafter: the EAGLE head, except where the text repeats itself. Summaries, RAG answers, code edits and
agent tool loops copy spans of their prompt; there a step whose last tokens occur earlier in the context (prompt
and answer so far) proposes what followed them (prompt lookup: free, and right for as long as the copy goes on),
and elsewhere the head's chain or tree. The choice is made per step, on the context alone.

The head's session stays the source of truth: a lookup proposal is put in its place (``EagleDraftSession.proposal``)
so that the verdict's accepted tokens and their target features go to the head as if it had drafted them, and its
next chain starts from them. A lookup proposal is deterministic (q one-hot): sampled output stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.drafters import DrafterKind, DraftProposal, register
from services.eagle_draft import EagleDraftSession
from services.eagle_draft import start as start_eagle
from services.prompt_lookup import find_candidates

HYBRID_DRAFTER = "hybrid"
MIN_LOOKUP = 2  # a lookup proposal needs at least this many tokens; shorter matches leave the step to the head


@dataclass
class HybridSession:
    eagle: EagleDraftSession
    lookups: int = 0  # steps that proposed a lookup (for the benchmarks)

    @property
    def nbytes(self) -> int:
        return self.eagle.nbytes

    def propose_steps(self, k: int, forced: Sequence[int] = (), width: int = 1):
        lookup = find_candidates(self.eagle.tokens + list(forced), k)
        if len(lookup) >= min(MIN_LOOKUP, k):
            self.lookups += 1
            self.eagle.proposal = list(forced) + lookup
            return DraftProposal(lookup, None)
            yield  # (a generator, as the protocol's steps are; a lookup asks the engine for nothing)
        return (yield from self.eagle.propose_steps(k, forced, width))

    def pre_draft_steps(self, k: int, forced: Sequence[int], guesses: int):
        return (yield from self.eagle.pre_draft_steps(k, forced, guesses))

    def accept(self, n_matches: int, next_token: int, features=None) -> None:
        self.eagle.accept(n_matches, next_token, features)


def _start(engine, ids: list[int], params, features) -> HybridSession:
    return HybridSession(start_eagle(engine, ids, params, features))


register(DrafterKind(HYBRID_DRAFTER, _start, needs="head", reads_features=True, pre_draft_guesses=3))
