"""Prompt lookup proposes what followed the latest earlier match of the suffix n-gram."""

from services.prompt_lookup import find_candidates


def test_longest_suffix_match_wins():
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # suffix (6, 7) occurs at 6 (followed by 2, 3) and at 1 (followed by 8, 9): the latest wins
    assert find_candidates(tokens, 2) == [2, 3]


def test_trigram_preferred_over_bigram():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    assert find_candidates(tokens, 1) == [4]


def test_no_match_proposes_nothing():
    assert find_candidates([1, 2, 3, 4], 3) == []


def test_proposal_is_capped_at_k():
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert find_candidates(tokens, 3) == [2, 3, 4]
