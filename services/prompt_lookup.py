"""Prompt-lookup drafting: propose the tokens that followed the latest earlier
occurrence of the current n-gram (Saxena 2023, "Prompt Lookup Decoding").

Free drafting: no model runs. Agent and code-editing outputs copy long spans
of their prompt, so matches are frequent there. The proposal is deterministic,
so its draft distribution q is one-hot and verification stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MAX_NGRAM = 3  # longest suffix n-gram searched for
DEFAULT_MIN_NGRAM = 1  # shortest (1 = a single repeated token may start a match)


def find_candidates(
    tokens: Sequence[int],
    k: int,
    *,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = DEFAULT_MIN_NGRAM,
) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tokens - n :])
        # scan right to left for the most recent earlier occurrence of the suffix
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []
