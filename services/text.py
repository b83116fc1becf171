"""Text in and out: prompts and chat messages to token ids; generated tokens to text, cut at stop sequences.

``TextStream`` is shared by the unary and the streaming API so that stream
chunks concatenate to exactly the unary answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from services.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence
CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_SEQUENCES = 8


def encode_prompt(tokenizer, prompt: str, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of raw ``prompt`` text (tokenizer defaults) or of chat ``messages`` (chat template)."""
    if prompt and messages:
        raise InvalidRequestError("set either prompt or messages, not both")
    if messages:
        for role, content in messages:
            if role not in CHAT_ROLES:
                raise InvalidRequestError(f"chat message role must be one of {list(CHAT_ROLES)}, got {role!r}")
            if not content:
                raise InvalidRequestError(f"chat message of role {role!r} has no content")
        chat = [{"role": role, "content": content} for role, content in messages]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    if not prompt:
        raise InvalidRequestError("prompt is empty: send prompt text or chat messages")
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of one user message under the chat template (``encode_prompt`` without its checks)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def token_pieces(tokenizer, token_ids: Sequence[int]) -> list[tuple[str, bytes]]:
    """Each token's text (decoded alone, special tokens included) and its exact UTF-8 bytes: a byte-level BPE token
    that ends inside a character decodes to U+FFFD, but its bytes are the token's own (GPT-2's byte alphabet); other
    tokenizers' bytes are those of the text."""
    byte_level = _byte_level(tokenizer)
    alphabet = _byte_alphabet() if byte_level else {}
    pieces = []
    for token, piece in zip(token_ids, tokenizer.convert_ids_to_tokens(list(token_ids)) if byte_level else token_ids):
        text = tokenizer.decode([int(token)])
        exact = byte_level and isinstance(piece, str) and all(c in alphabet for c in piece)
        pieces.append((text, bytes(alphabet[c] for c in piece) if exact else text.encode("utf-8")))
    return pieces


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


@cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of its ``bytes_to_unicode``): printable bytes
    stand for themselves, the others for 256 + their rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def validate_stop(stop: Sequence[str], max_chars: int | None = None) -> list[str]:
    stop = list(stop)
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}")
    if any(not s for s in stop):
        raise InvalidRequestError("stop sequences must not be empty strings")
    if max_chars is not None and (longest := max(map(len, stop), default=0)) > max_chars:
        raise InvalidRequestError(f"stop sequences must be at most {max_chars} characters, got one of {longest}")
    return stop


class TextStream:
    """Detokenise generated tokens incrementally and stop at the first stop sequence.

    ``push(tokens)`` takes one step's tokens and returns (the tokens kept, new
    text that is safe to emit); text that may still become a stop sequence or
    an incomplete UTF-8 character is held back until ``flush()``.

    Decoding is incremental (as vLLM's detokenizer): each step decodes a
    window from the last point where the text was complete, not the whole
    output, so a request's detokenisation costs O(n), not O(n^2).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = validate_stop(stop)
        self.token_ids: list[int] = []
        self.text = ""  # text emitted so far
        self.stopped = False  # a stop sequence was generated
        self._stable = ""  # text of token_ids[:_read], final (ends on a whole character)
        self._prefix = 0  # window start: the tokens before _read whose text is already in _stable
        self._read = 0

    def push(self, token_ids: Sequence[int]) -> tuple[list[int], str]:
        if self.stopped:
            return [], ""
        kept: list[int] = []
        for token in token_ids:  # one at a time: a stop sequence ends at a token boundary
            self.token_ids.append(int(token))
            kept.append(int(token))
            if self.stop and self._cut_at_stop():
                return kept, self._emit(self._stop_text)
        return kept, self._emit(self._safe_text())

    def flush(self) -> str:
        """The held-back rest, once generation has finished."""
        if self.stopped:
            return ""
        return self._emit(self._decode())

    def _decode(self) -> str:
        """The text of every token so far, decoding only the window since the last complete character."""
        if self._read == len(self.token_ids):
            return self._stable
        known = self.tokenizer.decode(self.token_ids[self._prefix : self._read], skip_special_tokens=True)
        window = self.tokenizer.decode(self.token_ids[self._prefix :], skip_special_tokens=True)
        if not window.startswith(known):  # the tokenizer changed text across the window's start: decode it all
            full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            if not full.endswith(REPLACEMENT_CHAR):
                self._stable, self._prefix, self._read = full, len(self.token_ids), len(self.token_ids)
            return full
        new = window[len(known) :]
        if not new.endswith(REPLACEMENT_CHAR):  # complete: the window moves on
            self._stable += new
            self._prefix, self._read = self._read, len(self.token_ids)
            return self._stable
        return self._stable + new

    def _cut_at_stop(self) -> bool:
        text = self._decode()
        starts = [i for i in (text.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if i >= 0]
        if not starts:
            return False
        self.stopped = True
        self._stop_text = text[: min(starts)]
        return True

    def _safe_text(self) -> str:
        text = self._decode()
        end = len(text)
        while end > len(self.text) and text[end - 1] == REPLACEMENT_CHAR:
            end -= 1  # an incomplete character: wait for its next bytes
        hold = 0
        for s in self.stop:  # the longest tail that could still grow into a stop sequence
            for n in range(min(len(s) - 1, end), 0, -1):
                if text[end - n : end] == s[:n]:
                    hold = max(hold, n)
                    break
        return text[: end - hold]

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.text):
            return ""
        delta = text[len(self.text) :]
        self.text = text
        return delta
