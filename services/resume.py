"""Where a fresh session goes on from after its replica was lost: one rule for the verify session (the ingress,
deployments.decoding), the draft session (the verify replica, deployments.verify) and the in-process tests.

The fresh session holds the prompt and every emitted token but the last, and goes on from that last token, the
state the lost one had before its failed call. Its sampling parameters are reseeded by position, so that a seeded
request's draws are those of a fresh request over the same context (``sampling.reseeded``), and the sampled output
still follows the target's distribution. Before the first token: the prompt alone, in full, as if nothing had been
lost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.sampling import SamplingParams, reseeded


@dataclass
class Resumption:
    ids: list[int]  # the context to prefill
    params: SamplingParams
    last_token: int | None  # the token the session goes on from; None before the first (the prefill draws it)
    max_new_tokens: int  # what is left to generate, that last token included


def resume_from(prompt_ids: list[int], params: SamplingParams, max_new_tokens: int, emitted: list[int]) -> Resumption:
    if not emitted:
        return Resumption(list(prompt_ids), params, None, max_new_tokens)
    params = reseeded(params, len(emitted))
    if params.constraint is not None:  # its grammar starts after the answer's tokens the context holds
        params = replace(params, constraint=params.constraint.after(emitted[:-1]))
    return Resumption(list(prompt_ids) + emitted[:-1], params, emitted[-1], max_new_tokens - (len(emitted) - 1))
