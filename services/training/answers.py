"""The target's greedy answers to prompts, in batches: what the training recipes learn from.

Prompts are left padded to the longest of their batch (``left_padded``); an answer ends at its first EOS
(``answer_length``).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from services.text import chat_ids


def pad_and_eos(model, tokenizer) -> tuple[int, set[int]]:
    """The pad id for batched ``generate`` and the set of EOS ids that end an answer."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = model.generation_config.eos_token_id
    return pad, set(eos) if isinstance(eos, (list, tuple)) else {eos}


def left_padded(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` [B, width] of a batch of prompts, left padded to the longest."""
    width = max(map(len, batch))
    input_ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])  # [B, width]
    attention = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])  # [B, width]
    return input_ids, attention


def answer_length(answer: list[int], eos: set[int]) -> int:
    """Tokens of a generated answer up to and including its first EOS (all of it if none)."""
    return next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))


@torch.inference_mode()
def generate_answers(target, tokenizer, prompts: list[str], *, max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """The target's greedy answers (ids after the chat prompt, up to and including EOS)."""
    pad, eos = pad_and_eos(target, tokenizer)
    encoded = [chat_ids(tokenizer, p) for p in prompts]  # in prompt order: the batches are part of the recipe
    answers = []
    for start in tqdm(range(0, len(encoded), batch_size), desc="target answers", unit="batch"):
        batch = encoded[start : start + batch_size]
        input_ids, attention = left_padded(batch, pad)
        width = input_ids.shape[1]
        out = target.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=pad)
        for row in out[:, width:].tolist():  # [B, T]
            answers.append(row[: answer_length(row, eos)])
    return answers
