"""Training answers through the engine's runner with continuous batching: the target's own answers, greedy as it
answers one prompt alone, sampled from the request distribution's top-k."""

import torch

from services.runner import make_runner
from services.sampling import SamplingParams, logits_to_probs
from services.training.answers import continuous_answers, draw_top_k, sampled_params

EOS = {3}


def alone(runner, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The greedy answer of ``prompt`` with nothing else in the pass."""
    cache, answer, ids = runner.new_cache(), [], torch.tensor(prompt)
    while len(answer) < max_new_tokens and (not answer or answer[-1] not in EOS):
        answer.append(int(runner.forward(ids, cache, last_only=True)[-1].argmax()))
        ids = torch.tensor(answer[-1:])
    return answer


def test_greedy_answers_are_each_prompts_own_as_slots_free_up(tiny):
    """More prompts than slots, of several lengths: a finished answer's slot takes the next prompt, prefills and
    decodes share passes, and every answer is the one its prompt gets alone."""
    runner = make_runner(tiny[0])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, tiny[0].vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 1, 6, 4, 12, 2)]
    prompts.append(prompts[0][:2] + [3])  # (EOS in a prompt does not end its answer)
    answers = continuous_answers(runner, prompts, eos=EOS, max_new_tokens=7, params=SamplingParams(),
                                 generator=torch.Generator(), slots=3)
    assert answers == [alone(runner, p, 7) for p in prompts]
    assert all(1 <= len(a) <= 7 for a in answers)


def test_sampled_answers_follow_the_seed(tiny):
    runner = make_runner(tiny[0])
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

    def answers(seed: int) -> list[list[int]]:
        return continuous_answers(runner, prompts, eos=EOS, max_new_tokens=6, params=sampled_params(0.8),
                                  generator=torch.Generator().manual_seed(seed), slots=2)

    assert answers(1) == answers(1)
    assert answers(1) != answers(2)


def test_top_k_draws_follow_the_samplers_distribution():
    """``draw_top_k`` draws from ``logits_to_probs``' distribution (temperature, top-k, top-p): the empirical
    frequencies of 40,000 seeded draws are within 0.01 of it, and nothing outside its support is drawn."""
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(3)) * 3  # [1, vocab]
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    probs = logits_to_probs(logits, params)[0]  # [vocab]
    draws = draw_top_k(logits.expand(40_000, -1), params, torch.Generator().manual_seed(0))  # [40000]
    freq = torch.bincount(draws, minlength=200).float() / draws.numel()
    assert set(draws.unique().tolist()) <= set(probs.nonzero().flatten().tolist())
    assert (freq - probs).abs().max() < 0.01
