"""A verify session's KV, whatever its origin, takes a draft tree's accepted side-node path at every depth.

Spec-Bench question 139 failed with INTERNAL on a fresh service: a session whose KV buffer had grown inside a forward
pass (under ``torch.inference_mode``) held an inference tensor, and compacting an accepted side-node path into it
(``DenseKVCache.keep``, outside inference mode) raised. The rule now: every KV buffer is allocated by
``services.kv.new_buffer``, a normal tensor even inside inference mode, so what the engine writes into it in place
works in or outside inference mode.

Each origin of a verify session's KV (a fresh prefill, a prefix-cache hit, a local prefill, a recovery re-prefill,
a payload through the object store) is crossed with an accepted side node at each depth, on a session that grows past
its buffer's first capacity; the tokens are the target's own.
"""

import pickle

import pytest
import torch

from services.fast_llama import INITIAL_CAPACITY
from services.models.tiny import TINY_VOCAB_SIZE
from services.prefill import PrefillEngine
from services.sampling import SamplingParams
from services.verify import VerifyCall, VerifyEngine
from tests.conftest import greedy_reference

K = 3  # chain rows per step; the side node is row K + 1
PROMPT = [1] + [(7 * i) % 90 + 5 for i in range(INITIAL_CAPACITY - 8)]  # grows past the first capacity in a few steps
NEW_TOKENS = 40
GREEDY = SamplingParams()


def _tree_step(verify: VerifyEngine, request_id: str, want: list[int], depth: int) -> list[int]:
    """One verify call whose chain is right up to ``depth - 1`` and wrong at ``depth``, with the right token at
    ``depth`` as a side node (a child of chain row ``depth - 1``): the accepted path ends in that side node."""
    wrong = [(t + 1) % TINY_VOCAB_SIZE for t in want[:K]]
    chain = want[: depth - 1] + wrong[depth - 1 : K]
    parents = tuple(range(K)) + (depth - 1,)
    (result,) = verify.verify_batch([VerifyCall(request_id, chain + [want[depth - 1]], tree_parents=parents)])
    if isinstance(result, Exception):
        raise result
    assert result.path == list(range(1, depth)) + [K + 1], (depth, result.path)
    return result.token_ids


def _opened(origin: str, target, verify: VerifyEngine, request_id: str, reference: list[int]) -> list[int]:
    """Open ``request_id`` from ``origin``; the tokens emitted so far."""
    if origin == "local prefill":
        prefill = PrefillEngine(target, prefix_cache_bytes=2**24)
        prefill.prefill(PROMPT[:-1] + [95], GREEDY)  # caches all but the prompt's last position
        handed = prefill.prefill(PROMPT, GREEDY, local_tokens=4)
        assert handed.first_token is None and handed.prompt_rest
        verify.open(request_id, handed.payload, None, GREEDY, prompt_rest=handed.prompt_rest)
        (first,) = verify.verify_batch([VerifyCall(request_id, [], prompt_rows=len(handed.prompt_rest) - 1)])
        return first.token_ids
    if origin == "prefix-cache hit":
        prefill = PrefillEngine(target, prefix_cache_bytes=2**24)
        prefill.prefill(PROMPT[:-6] + [90, 91], GREEDY)
        result = prefill.prefill(PROMPT, GREEDY)
        assert prefill.prefix_cache.hit_tokens > 0
    else:
        result = PrefillEngine(target).prefill(PROMPT, GREEDY)
    payload = result.payload
    if origin == "object store":
        payload = pickle.loads(pickle.dumps(payload, protocol=5))  # what ray.put / ray.get do to it
    verify.open(request_id, payload, result.first_token, GREEDY)
    emitted = [result.first_token]
    if origin == "recovery re-prefill":  # a step, then the session is lost and opened again from a re-prefill
        emitted += _tree_step(verify, request_id, reference[1:], 1)
        verify.close(request_id)
        again = PrefillEngine(target).prefill(PROMPT + emitted[:-1], GREEDY)
        verify.open(request_id, again.payload, emitted[-1], GREEDY)
    return emitted


@pytest.mark.parametrize("origin", ["fresh prefill", "prefix-cache hit", "local prefill", "recovery re-prefill",
                                    "object store"])
def test_side_node_paths_at_every_depth_whatever_the_kv_origin(tiny, origin):
    target, _ = tiny
    reference = greedy_reference(target.model, PROMPT, NEW_TOKENS)
    verify = VerifyEngine(target)
    emitted = _opened(origin, target, verify, "r", reference)
    assert emitted == reference[: len(emitted)]
    grown = False
    for step in range(3 * K):
        depth = step % K + 1
        emitted += _tree_step(verify, "r", reference[len(emitted) :], depth)
        assert emitted == reference[: len(emitted)], (origin, step)
        buffer = verify.sessions.get("r").cache.buffer
        assert not buffer.is_inference(), "a KV buffer became an inference tensor"
        grown = grown or buffer.shape[3] > INITIAL_CAPACITY
    verify.close("r")
    assert grown, "the session never grew past its first capacity: the case that failed was not exercised"


def test_kv_buffers_are_normal_tensors_inside_inference_mode():
    from services.kv import new_buffer

    with torch.inference_mode():
        buffer = new_buffer((2, 3), torch.float32)
        buffer[0] = torch.ones(3)  # written in place inside inference mode ...
    assert not buffer.is_inference()
    buffer[1] = buffer[0]  # ... and outside it
    assert buffer.sum() == 6
