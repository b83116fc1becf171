"""The KV cache the engine keeps per session, and its transferable payload.

A ``KVPayload`` is what prefill hands to a verifier: per-layer key/value numpy
arrays (the Ray object store hands numpy arrays over zero-copy on one node),
the sequence length, and the fingerprint of the model that computed them. A
verifier refuses a payload whose fingerprint is not its own model's.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from services.errors import ModelMismatchError


@dataclass
class KVPayload:
    """KV cache of a prefix, in a form the Ray object store can hand over zero-copy."""

    keys: list[np.ndarray]  # per layer: [num_kv_heads, seq_len, head_dim]
    values: list[np.ndarray]  # per layer: [num_kv_heads, seq_len, head_dim]
    seq_len: int
    fingerprint: str  # model id + config hash + dtype of the model that computed it
    dtype: str = "float32"  # of the tensors; bfloat16 travels as its int16 bit pattern (numpy has no bfloat16)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def compact(self) -> "KVPayload":
        """The same KV in contiguous arrays of its own (a prefix's views into a longer payload are not: the object
        store hands contiguous arrays over zero-copy)."""
        return dataclasses.replace(self, keys=[np.ascontiguousarray(k) for k in self.keys],
                                   values=[np.ascontiguousarray(v) for v in self.values])


def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu", *,
               zeroed: bool = False) -> torch.Tensor:
    """The one allocator of KV buffers (the target's, the drafter's, an EAGLE head's).

    The engine's rule for inference mode: forward passes run under ``torch.inference_mode``; what outlives them, a
    session's KV buffer, is a normal tensor, allocated here even when a pass grows it. A buffer allocated inside
    inference mode would be an inference tensor, which no code outside it may write in place (a draft tree's
    accepted path compacted into the KV, ``DenseKVCache.keep``: Spec-Bench question 139 failed on that). A normal
    tensor is written in place in and outside inference mode alike.
    """
    with torch.inference_mode(False):
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)


def check_fingerprint(payload: KVPayload, fingerprint: str) -> None:
    """Refuse KV computed by another model than the one about to use it."""
    if payload.fingerprint != fingerprint:
        raise ModelMismatchError(
            f"KV payload was computed by {payload.fingerprint!r}, this verifier runs {fingerprint!r}; "
            "prefill and verify must serve the same target model"
        )


class KVCache:
    """A growing, croppable KV cache for one sequence (batch size 1)."""

    def __init__(self, config):
        self.config = config
        self.cache = DynamicCache(config=config)

    @property
    def seq_len(self) -> int:
        return self.cache.get_seq_length()

    @property
    def nbytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes
            for layer in self.cache.layers
            if getattr(layer, "is_initialized", False) and layer.keys is not None
        )

    def crop(self, length: int) -> None:
        """Roll back to the first ``length`` positions (rejected tokens are forgotten)."""
        excess = self.seq_len - length
        if excess < 0:
            raise ValueError(f"cannot crop a cache of {self.seq_len} positions to {length}")
        if excess:
            self.cache.crop(-excess)

    def export(self, fingerprint: str) -> KVPayload:
        """Copy the cache out as contiguous host numpy arrays (one copy — device to host on a GPU — then zero-copy)."""
        first = self.cache.layers[0].keys
        dtype = str(first.dtype).removeprefix("torch.")
        keys = [to_numpy(layer.keys[0]) for layer in self.cache.layers]
        values = [to_numpy(layer.values[0]) for layer in self.cache.layers]
        return KVPayload(keys=keys, values=values, seq_len=self.seq_len, fingerprint=fingerprint, dtype=dtype)

    @classmethod
    def from_payload(cls, config, payload: KVPayload, fingerprint: str, device: torch.device | str = "cpu") -> "KVCache":
        """Adopt a payload's arrays without copying them; refuse KV from another model."""
        check_fingerprint(payload, fingerprint)
        kv_cache = cls(config)
        if len(payload.keys) != len(kv_cache.cache.layers):
            raise ModelMismatchError(
                f"KV payload has {len(payload.keys)} layers, the model has {len(kv_cache.cache.layers)}"
            )
        for layer, k, v in zip(kv_cache.cache.layers, payload.keys, payload.values):
            key_states = as_tensor(k, payload.dtype).to(device)[None]  # [1, num_kv_heads, seq_len, head_dim]
            value_states = as_tensor(v, payload.dtype).to(device)[None]
            layer.lazy_initialization(key_states, value_states)
            # The arrays may be read-only object-store memory: adopt them as they
            # are; the next update concatenates into a fresh tensor, never in place.
            layer.keys, layer.values = key_states, value_states
        return kv_cache


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host copy; bfloat16 as its int16 bit pattern."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.cpu().numpy()


def as_tensor(array: np.ndarray, dtype: str = "float32") -> torch.Tensor:
    """A tensor view of ``array`` (``dtype``: the payload's); read-only arrays (object-store memory) are only read."""
    with warnings.catch_warnings():
        # torch warns on read-only buffers; it never writes to them here (see above)
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor
