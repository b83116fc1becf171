"""TextStream: incremental text equals a full decode, stop sequences cut exactly, held-back text is flushed."""

import pytest

from services.errors import InvalidRequestError
from services.text import TextStream, encode_prompt


@pytest.fixture(scope="module")
def tokenizer():
    from services.loading import describe
    from services.models import default_pair

    return describe(default_pair.prepare_target()).tokenizer


def _run(tokenizer, ids, stop, step=2):
    stream, chunks, kept = TextStream(tokenizer, stop), [], []
    for i in range(0, len(ids), step):
        got, text = stream.push(ids[i : i + step])
        kept += got
        chunks.append(text)
        if stream.stopped:
            break
    chunks.append(stream.flush())
    return "".join(chunks), kept, stream


@pytest.mark.parametrize("step", [1, 3])
def test_concatenation_equals_decode(tokenizer, step):
    ids = tokenizer("Héllo wörld — naïve café ☕ 日本語 and more", add_special_tokens=False)["input_ids"]
    text, kept, _ = _run(tokenizer, ids, [], step)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert kept == ids


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_sequence_cuts_before_it(tokenizer, step):
    ids = tokenizer("1, 2, 3, 4, 5, 6, 7, 8", add_special_tokens=False)["input_ids"]
    text, kept, stream = _run(tokenizer, ids, ["5,", "zzz"], step)
    assert stream.stopped and text == "1, 2, 3, 4, "
    assert tokenizer.decode(kept).startswith("1, 2, 3, 4, 5,")  # tokens through the stop sequence
    assert len(kept) < len(ids)


def test_partial_stop_is_held_back_then_flushed(tokenizer):
    ids = tokenizer("abc STO", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, ["STOP"])
    _, text = stream.push(ids)
    assert not text.endswith("STO")
    assert text + stream.flush() == "abc STO"


def test_prompt_or_messages(tokenizer):
    with pytest.raises(InvalidRequestError, match="empty"):
        encode_prompt(tokenizer, "", [])
    with pytest.raises(InvalidRequestError, match="not both"):
        encode_prompt(tokenizer, "hi", [("user", "hi")])
    with pytest.raises(InvalidRequestError, match="role"):
        encode_prompt(tokenizer, "", [("robot", "hi")])
    chat = encode_prompt(tokenizer, "", [("user", "hi")])
    assert chat == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)["input_ids"]


class _CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call reads."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_long_output_decodes_in_bounded_windows(tokenizer):
    """O(n) detokenisation: every decode reads a short window, and the text still equals a full decode."""
    sentence = "Naïve café ☕ 日本語 — the quick brown fox jumps over the lazy dog. "
    ids = tokenizer(sentence * 40, add_special_tokens=False)["input_ids"]
    counting = _CountingTokenizer(tokenizer)
    text, kept, _ = _run(counting, ids, ["never appears"], step=3)
    assert text == tokenizer.decode(ids, skip_special_tokens=True) and kept == ids
    assert len(ids) > 500 and max(counting.lengths) <= 16
