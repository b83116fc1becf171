"""Draft trees: a verify block of several candidate continuations, checked in one target pass (greedy only).

A chain proposes one token per position; a tree also proposes the drafter's
next most likely tokens as siblings (SpecInfer, arXiv 2305.09781; EAGLE-2's
draft trees, arXiv 2406.16858). Here the tree is the chain plus ``width - 1``
side nodes at its first depth, children of the pending token: the drafter
already computed their logits, so a tree costs no more drafting than its
chain, and on a memory-bound target a pass over a few more rows costs about
what the chain's does. Deeper depths get no side nodes (``side_widths``): a
side node at depth d is only reached when the chain's first d - 1 tokens are
accepted (about half of the steps at depth 2), so it adds less than it costs
once a pass outgrows the rows it takes for free.

The target scores every node in one pass: node i attends to the cached
context, the pending token and its own ancestors only (a tree attention mask,
positions by depth). Greedy acceptance walks from the pending token: while
the target's argmax at the current node is one of its children, accept that
child; then emit the argmax (the bonus token). The accepted path is exactly
what the target alone would have generated, so greedy output is unchanged.
Sampled requests keep chains: exact rejection sampling over a tree needs
multi-draft rules this code does not implement.

Rows: 0 is the pending token, row i >= 1 is draft node i - 1; ``parents[i - 1]``
is the row of node i - 1's parent (0 = the pending token), and a parent
precedes its children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.errors import InvalidRequestError

MAX_TREE_WIDTH = 4  # candidates at the first depth (the chain's and 3 side nodes)


def chain_parents(k: int) -> list[int]:
    """The parents of a chain of k drafts: each node's parent is the row before it."""
    return list(range(k))


def sides_at(depth: int, width: int) -> int:
    """Side nodes at ``depth`` (0 = the first) of a tree of ``width``: ``width - 1`` at the first, none deeper (see
    the module docstring). The one rule of the trees' shape."""
    return width - 1 if depth == 0 else 0


def side_widths(chain_len: int, width: int) -> list[int]:
    """Side nodes per depth of a tree of ``width`` over a chain of ``chain_len``."""
    return [sides_at(depth, width) for depth in range(chain_len)]


def tree_rows(k: int, width: int) -> int:
    """Rows a verify pass over a step of k drafts takes: the pending token, the chain and its side nodes."""
    return 1 + k + sum(side_widths(k, width))


def side_tree(chain_len: int, width: int) -> list[int]:
    """Parents of a chain of ``chain_len`` (rows 1 .. chain_len) followed by ``width - 1`` side nodes at each depth
    d = 1 .. chain_len, each a child of the chain row at depth d - 1 (row 0: the pending token)."""
    return chain_parents(chain_len) + [d for d in range(chain_len) for _ in range(width - 1)]


def chain_length(parents: Sequence[int]) -> int:
    """The chain at the front of a draft tree (``with_sides``): nodes whose parent is the row before."""
    return next((i for i, p in enumerate(parents) if p != i), len(parents))


def side_ids(logits: torch.Tensor, width: int, chosen: int, depth: int = 0) -> list[int]:
    """The side nodes at ``depth`` of a tree of ``width`` (``sides_at``): the most likely ids of ``logits`` [V] other
    than the chain's ``chosen`` one (never an id at -inf: one a grammar forbids, services.constraint)."""
    n = sides_at(depth, width)
    if n <= 0:
        return []
    top = torch.topk(logits, min(n + 1, logits.shape[-1])).indices.tolist()
    return [int(t) for t in top if t != chosen and logits[t] > float("-inf")][:n]


def with_sides(chain: list[int], sides: list[list[int]]) -> tuple[list[int], list[int]]:
    """(token ids, parents) of a chain followed by its side nodes, ``sides[d]`` at depth d + 1 (children of row d)."""
    parents = chain_parents(len(chain)) + [d for d, ids in enumerate(sides) for _ in ids]
    return chain + [t for ids in sides for t in ids], parents


@dataclass(frozen=True)
class DraftTree:
    parents: tuple[int, ...]  # per draft node, its parent's row

    @classmethod
    def checked(cls, parents: Sequence[int], k: int) -> "DraftTree":
        """A tree of k draft nodes; bad parents are an InvalidRequestError."""
        parents = tuple(int(p) for p in parents)
        if len(parents) != k or any(not 0 <= p <= i for i, p in enumerate(parents)):
            raise InvalidRequestError(f"draft tree parents must be {k} rows, each before its node (0 = the pending "
                                      f"token), got {list(parents)}")
        return cls(parents)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(len(self.parents)))

    def depths(self) -> list[int]:
        """Per row, its depth below the pending token (row 0: 0)."""
        depths = [0]
        for p in self.parents:
            depths.append(depths[p] + 1)
        return depths

    def ancestors(self) -> torch.Tensor:  # -> [n, n] bool, n = k + 1: row i may attend to row j
        n = len(self.parents) + 1
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents, start=1):
            mask[i] |= mask[p]
        return mask

    def greedy_walk(self, draft: torch.Tensor, target_ids: torch.Tensor) -> tuple[list[int], int]:
        """(accepted rows, in order; the bonus token): follow the target's argmax from the pending token while it
        is a child of the current row. ``draft`` [k] ids, ``target_ids`` [k + 1] the argmax of each row's logits."""
        argmax = target_ids.tolist()  # [k + 1]
        ids = draft.tolist()
        path, row = [], 0
        while True:
            child = next((i + 1 for i, p in enumerate(self.parents) if p == row and ids[i] == argmax[row]), None)
            if child is None:
                return path, argmax[row]
            path.append(child)
            row = child
