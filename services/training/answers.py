"""The target's answers to prompts, in batches: what the training recipes learn from.

``continuous_answers``: the engine's runner (``services.runner``) with continuous batching: every sequence has its
own KV, a finished answer's slot takes the next prompt at once, and a pass reads each weight once for every slot's
token. ``generate_answers``: transformers' ``generate`` on prompts left padded to the longest of their batch
(``left_padded``). An answer ends at its first EOS (``answer_length``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from tqdm.auto import tqdm

from services.sampling import SamplingParams, logits_to_probs, sample
from services.text import chat_ids

# what transformers' ``generate`` samples from with ``do_sample`` (its default top-k is 50), so that sampled data
# is alike whichever path answered it
SAMPLED_TOP_K, SAMPLED_TOP_P = 50, 0.95


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


def sampled_params(temperature: float) -> SamplingParams:
    """The distribution a training answer is drawn from: greedy at 0, else the temperature with top-k and top-p."""
    return SamplingParams(temperature=temperature, top_k=SAMPLED_TOP_K, top_p=SAMPLED_TOP_P) if temperature > 0 \
        else SamplingParams()


def draw_top_k(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token per row [n] from ``logits`` [n, vocab_size] warped by ``params`` (top-k set): the distribution of
    ``sampling.logits_to_probs``, computed over each row's top-k only (no sort of the whole vocabulary)."""
    values, ids = torch.topk(logits.float(), params.top_k, dim=-1)  # [n, top_k], descending
    probs = logits_to_probs(values, replace(params, top_k=0))  # [n, top_k]
    return ids.gather(-1, sample(probs, generator)[:, None]).squeeze(-1)


@torch.inference_mode()
def continuous_answers(runner, prompts: list[list[int]], *, eos: set[int], max_new_tokens: int,
                       params: SamplingParams, generator: torch.Generator, slots: int = 32) -> list[list[int]]:
    """Each prompt's answer (ids after it, up to and including EOS), in ``prompts``' order, through ``runner``'s
    ``forward_batch`` with up to ``slots`` sequences at a time: prompts are taken in order as slots free up (their
    prefills share one pass), then every slot advances one token a pass. Greedy rows take the runner's argmax ids;
    sampled ones draw from ``params``' distribution with ``generator``, one draw per slot a pass: a seed gives the
    same answers for the same prompts and ``slots``."""
    answers: list[list[int]] = [[] for _ in prompts]
    waiting = list(range(len(prompts)))[::-1]  # popped from the end: prompt order
    active: list[tuple[int, object]] = []  # (prompt index, its KV) of the sequences being answered
    while waiting or active:
        admitted = []
        while waiting and len(active) + len(admitted) < slots:
            i = waiting.pop()
            cache = runner.new_cache()
            cache.reserve(len(prompts[i]) + max_new_tokens)
            admitted.append((i, cache))
        chunks = [(torch.tensor(prompts[i]), cache) for i, cache in admitted]  # prefill: the whole prompt
        chunks += [(torch.tensor(answers[i][-1:]), cache) for i, cache in active]  # decode: the last token
        active = admitted + active
        outputs, _ = runner.forward_batch(chunks, last_only=True, greedy=[params.greedy] * len(chunks))
        if params.greedy:
            tokens = [int(ids[-1]) for ids in outputs]
        else:
            tokens = draw_top_k(torch.cat([logits[-1:] for logits in outputs]), params, generator).tolist()
        for (i, _), token in zip(active, tokens, strict=True):
            answers[i].append(token)
        active = [(i, cache) for i, cache in active if answers[i][-1] not in eos and len(answers[i]) < max_new_tokens]
    return answers
