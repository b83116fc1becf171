"""Prefix caching for prefill: the KV of recent prompts, reused by a prompt that starts with the same tokens.

Chat prompts share their opening (the template's system turn: 24 of the
default pair's ~42 prompt tokens), and agent workloads resend a long shared
context turn after turn. Prefill is compute-bound, so computing a shared
prefix once saves most of its cost — vLLM's automatic prefix caching, here on
the host, where the prefill's KV payload already lies.

A prompt's KV is kept once, as the ``KVPayload`` prefill made for the
handoff; each of its prefixes at a multiple of ``block`` tokens points to it
through a chain of block hashes; a hit is checked against the stored ids and
then extended token by token as far as the stored prompt goes on like the
new one (as SGLang's radix cache matches tokens, not blocks): the same prompt
again leaves one position to compute, not up to a block. A lookup returns
the longest such prefix shorter than the prompt (the last position is always
computed: its logits give the first token). The least recently used prompts
go when the bytes pass ``max_bytes``.

Exactness: the reused KV was computed in another pass than a fresh prefill
would use, so it differs from a recomputation by float rounding only — as the
KV of a prompt batched with others or prefilled in chunks does; the sampler
is exact for whatever logits it is given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kv import KVPayload

PREFIX_BLOCK = 4  # tokens per lookup step: a hit reuses a multiple of this


@dataclass
class _Entry:
    ids: tuple[int, ...]  # the prompt whose KV this is
    payload: KVPayload
    features: torch.Tensor | None  # [n, hidden] the target's features of the prompt, where they were computed
    keys: list[int]  # its block-chain hashes (the index points some of them at newer entries)
    nbytes: int


@dataclass(frozen=True)
class PrefixHit:
    payload: KVPayload  # the first ``length`` positions of a cached prompt's KV
    features: torch.Tensor | None  # [length, hidden], or None
    length: int


class PrefixCache:
    """Least recently used prompt KVs, found by their block-aligned prefixes."""

    def __init__(self, max_bytes: int, block: int = PREFIX_BLOCK):
        self.max_bytes, self.block = max_bytes, block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # id(entry) -> entry, least recently used first
        self._index: dict[int, _Entry] = {}  # block-chain hash -> the newest entry with that prefix
        self.nbytes = 0
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of them, reused from the cache (prefix_cache_hits)

    def _chain(self, ids: Sequence[int], limit: int) -> list[tuple[int, int]]:
        """(length, hash) of each block-aligned prefix of ``ids`` up to ``limit`` tokens."""
        chain, h = [], 0
        for end in range(self.block, limit + 1, self.block):
            h = hash((h, tuple(ids[end - self.block : end])))
            chain.append((end, h))
        return chain

    def lookup(self, ids: Sequence[int], *, features: bool = False) -> PrefixHit | None:
        """The longest cached prefix of ``ids`` shorter than ``ids`` (with features, if asked for), or None: a block
        chain to a stored prompt, then as many of that prompt's further tokens as ``ids`` shares."""
        self.queried_tokens += len(ids)
        best = None
        for length, h in self._chain(ids, len(ids) - 1):
            entry = self._index.get(h)
            if entry is None:
                break
            if not features or entry.features is not None:
                best = (entry, length)
        if best is None:
            return None
        entry, length = best
        if entry.ids[:length] != tuple(ids[:length]):  # a hash collision: never reuse another prompt's KV
            return None
        limit = min(len(entry.ids), len(ids) - 1)
        while length < limit and entry.ids[length] == ids[length]:  # the rest of the stored prompt, where it matches
            length += 1
        self._entries.move_to_end(id(entry))
        self.hit_tokens += length
        payload = entry.payload
        prefix = KVPayload(keys=[k[:, :length] for k in payload.keys], values=[v[:, :length] for v in payload.values],
                           seq_len=length, fingerprint=payload.fingerprint, dtype=payload.dtype)
        return PrefixHit(prefix, entry.features[:length] if features else None, length)

    def insert(self, ids: Sequence[int], payload: KVPayload, features: torch.Tensor | None = None) -> None:
        """Keep a prompt's KV (and features) for the prompts that start like it."""
        nbytes = payload.nbytes + (features.nbytes if features is not None else 0)
        if self.max_bytes <= 0 or nbytes > self.max_bytes or len(ids) < self.block:
            return
        entry = _Entry(tuple(ids), payload, features, [h for _, h in self._chain(ids, len(ids))], nbytes)
        for h in entry.keys:
            held = self._index.get(h)
            if held is None or features is not None or held.features is None:  # one with features serves both
                self._index[h] = entry
        self._entries[id(entry)] = entry
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._evict(next(iter(self._entries.values())))

    def _evict(self, entry: _Entry) -> None:
        del self._entries[id(entry)]
        self.nbytes -= entry.nbytes
        for h in entry.keys:
            if self._index.get(h) is entry:
                del self._index[h]

    def __len__(self) -> int:
        return len(self._entries)
