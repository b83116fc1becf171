"""Input checks done once, at the engine's boundary, with messages a user can act on."""

from __future__ import annotations

from collections.abc import Sequence

from services.errors import InvalidRequestError

MIN_DRAFT_TOKENS = 1
MAX_DRAFT_TOKENS = 16  # beyond this the verify pass costs more than acceptance can repay


def validate_prompt(prompt_ids: Sequence[int], *, max_context: int, vocab_size: int) -> list[int]:
    """A non-empty prompt of valid token ids that leaves room for at least one new token."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise InvalidRequestError("prompt is empty: send at least one token of text")
    if len(ids) >= max_context:
        raise InvalidRequestError(
            f"prompt is {len(ids)} tokens, the model's context is {max_context}: "
            f"shorten the prompt to at most {max_context - 1} tokens"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def validate_num_draft_tokens(k: int) -> int:
    if not isinstance(k, int) or not MIN_DRAFT_TOKENS <= k <= MAX_DRAFT_TOKENS:
        raise InvalidRequestError(
            f"num_draft_tokens (k) must be an integer in [{MIN_DRAFT_TOKENS}, {MAX_DRAFT_TOKENS}], got {k!r}"
        )
    return k


def validate_max_new_tokens(max_new_tokens: int, *, prompt_len: int, max_context: int, limit: int | None = None) -> int:
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if limit is not None and max_new_tokens > limit:
        raise InvalidRequestError(f"max_new_tokens is {max_new_tokens}, the server's limit is {limit}")
    room = max_context - prompt_len
    if max_new_tokens > room:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {max_context}: ask for at most {room} new tokens"
        )
    return max_new_tokens
