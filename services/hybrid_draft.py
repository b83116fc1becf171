"""The hybrid drafter: the EAGLE head, except where the text repeats itself. Summaries, RAG answers, code edits and
agent tool loops copy spans of their prompt; there a step whose last tokens occur earlier in the context (prompt
and answer so far) proposes what followed them (prompt lookup: free, and right for as long as the copy goes on),
and elsewhere the head's chain or tree. The choice is made per step, on the context alone.

Greedy requests, where the context repeats, verify both in one draft tree (``merged_tree``): the lookup's chain and
the head's proposal beside it (its chain, or its tree), sharing the nodes where they agree. The target's pass takes
whichever is right, so a lookup that stops copying costs the step nothing more than the head's own would. Sampled
requests verify chains (exact rejection sampling over a tree is not implemented: services.tree): the lookup's.

The head's session stays the source of truth: the lookup chain is put in its place (``EagleDraftSession.proposal``)
so that the verdict's accepted tokens and their target features go to the head as if it had drafted them, and its
next chain starts from them. A lookup proposal is deterministic (q one-hot): sampled output stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.drafters import HYBRID_DRAFTER, DrafterKind, DraftProposal, register
from services.eagle_draft import EagleDraftSession
from services.eagle_draft import start as start_eagle
from services.prompt_lookup import find_candidates
from services.tree import chain_length, chain_parents, tree_rows

MIN_LOOKUP = 2  # a lookup proposal needs at least this many tokens; shorter matches leave the step to the head


@dataclass
class HybridSession:
    eagle: EagleDraftSession
    lookups: int = 0  # steps that proposed a lookup (for the benchmarks)

    @property
    def nbytes(self) -> int:
        return self.eagle.nbytes

    @property
    def grammar(self):  # (the head's session keeps the grammar and the proposal: services.draft.jump_forward)
        return self.eagle.grammar

    @property
    def proposal(self) -> list[int]:
        return self.eagle.proposal

    @proposal.setter
    def proposal(self, tokens: list[int]) -> None:
        self.eagle.proposal = tokens

    def propose_steps(self, k: int, forced: Sequence[int] = (), width: int = 1):
        # (a constrained request's lookup stops before the first token its grammar forbids)
        lookup = self.eagle.grammar.allowed_prefix(find_candidates(self.eagle.tokens + list(forced), k), after=forced)
        if len(lookup) < min(MIN_LOOKUP, k):
            return (yield from self.eagle.propose_steps(k, forced, width))
        self.lookups += 1
        if not self.eagle.params.greedy:
            self.eagle.proposal = list(forced) + lookup
            return DraftProposal(lookup, None)
        head = yield from self.eagle.propose_steps(k, forced, width)
        token_ids, parents = merged_tree(lookup, head.token_ids, head.parents or chain_parents(len(head.token_ids)))
        # the tree's chain, what the verdict's first accept counts: the lookup, and the head's nodes after its last
        # token where the head agreed with all of it (a lookup shorter than k: the match was near the context's end)
        self.eagle.proposal = list(forced) + token_ids[: chain_length(parents)]
        return DraftProposal(token_ids, None, parents=parents)

    def pre_draft_steps(self, k: int, forced: Sequence[int], guesses: int):
        return (yield from self.eagle.pre_draft_steps(k, forced, guesses))

    def accept(self, n_matches: int, next_token: int, features=None) -> None:
        self.eagle.accept(n_matches, next_token, features)


def merged_tree(chain: list[int], ids: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """(token ids, parents) of one draft tree (services.tree) holding ``chain`` as its chain (rows 1 .. len(chain))
    and the tree of ``ids`` / ``parents`` beside it: each of its nodes whose parent is on the chain and whose token is
    the chain's next is that chain node; the others follow in their order, with their parents' new rows."""
    merged_ids, merged_parents = list(chain), chain_parents(len(chain))
    row_of = {0: 0}  # a row of the tree beside -> its row in the merged tree
    for row, (token, parent) in enumerate(zip(ids, parents, strict=True), start=1):
        at = row_of[parent]
        if at < len(chain) and chain[at] == token:  # (rows 0 .. len(chain) are the pending token and the chain)
            row_of[row] = at + 1  # the chain's node after row ``at``
            continue
        merged_ids.append(token)
        merged_parents.append(at)
        row_of[row] = len(merged_ids)
    return merged_ids, merged_parents


def _start(engine, ids: list[int], params, features) -> HybridSession:
    return HybridSession(start_eagle(engine, ids, params, features))


def verify_rows(k: int, width: int) -> int:
    """A greedy step where the context repeats verifies the lookup's chain beside the head's chain or tree."""
    return tree_rows(k, width) + k


register(DrafterKind(HYBRID_DRAFTER, _start, needs="head", reads_features=True, pre_draft_guesses=3,
                     verify_rows=verify_rows))
