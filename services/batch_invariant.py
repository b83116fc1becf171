"""transformers' forward made batch-invariant: a token's logits do not depend on how many rows share its pass.

Greedy speculative decoding is lossless only if the verify pass scores each
draft exactly as the target would one token at a time: a k + 1-row pass that
rounds differently from a one-row step can move the argmax where the two best
logits nearly tie. The CPU's compact forward (``fast_llama``) is built that way
(its kernels compute each row on its own). transformers' forward — the path of
every model on a GPU, and of other architectures on the CPU — is not: the
matmul and attention kernels a backend picks depend on the number of rows and
keys (cuBLAS / MKL choose tiles and split-K by shape; SDPA splits the keys by
their count), and so does their order of summation.

``BatchInvariantRunner`` gives every decode forward one shape, whatever its
rows, as gpt-fast's static cache gives its decode steps (vLLM's
``VLLM_BATCH_INVARIANT=1`` gets there with Triton kernels whose order of
summation ignores the batch; this needs no kernels of its own):

- rows: a chunk of up to ``rows`` tokens (a verify block, a step, a short
  prompt rest) is padded to ``rows`` with copies of its last token; the
  padding's logits are dropped and its K/V, written past the sequence, is
  masked out of every later pass and overwritten by the next tokens;
- keys: the KV lives at fixed positions of a buffer of ``capacity``
  positions (``StaticKVCache``) and every pass attends over the whole buffer
  through an explicit mask (a row sees the positions up to its own);
- sessions: ``slots`` sessions' chunks share a pass of ``slots`` x ``rows``
  (empty slots padded on a spare buffer), each writing into and attending
  over its own buffer, so a session's bits do not depend on its neighbours.

So each matmul, norm and attention call of a decode pass has the same shape in
every pass, and a row's result depends on its own inputs only (a kernel of a
given shape computes every row the same way). Rolled back by a length, as
gpt-fast does. Longer chunks (prompts) run in one pass of their own length:
like the compact forward's prompts, their KV is the prefill's and the same on
either side of a comparison.

The cost: a step computes ``rows`` rows and attends over ``capacity`` keys,
which on a GPU (bound by memory and launches at these sizes) costs little, and
each session holds a buffer of ``capacity`` positions (``kv_capacity``).
"""

from __future__ import annotations

import torch

from services.errors import InvalidRequestError
from services.fast_llama import DenseKVCache
from services.kv import KVPayload, check_fingerprint, new_buffer
from services.hf_runner import ModelRunner
from services.validation import MAX_DRAFT_TOKENS

PASS_ROWS = MAX_DRAFT_TOKENS + 1  # the longest verify block: pending + k drafts; every shorter chunk is padded to it
CAPACITY_ALIGN = 64  # positions: a static buffer's size is a multiple of this


def supports(config) -> bool:
    """A model whose every layer attends over its full KV, keys and values of one head size per layer (no sliding
    window, no linear attention, no latent / compressed KV): the static buffer holds its cache."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if not all(kind == "full_attention" for kind in layer_types) or getattr(config, "sliding_window", None):
        return False
    if not all(hasattr(config, name) for name in ("num_key_value_heads", "num_hidden_layers", "num_attention_heads")):
        return False
    head_dim = kv_shape(config)[2]
    return getattr(config, "kv_lora_rank", None) is None and getattr(config, "v_head_dim", head_dim) == head_dim


def kv_shape(config) -> tuple[int, int, int]:  # (layers, kv_heads, head_dim)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


class StaticKVCache(DenseKVCache):
    """KV of one sequence at fixed positions of one buffer [layers, 2, kv_heads, capacity, head_dim] that never
    grows (the compact forward's ``DenseKVCache``, on the model's device, zeroed).

    Positions past ``seq_len`` hold stale K/V (rejected drafts, padding) that the mask hides and the next tokens
    overwrite; ``crop`` moves the length.
    """

    def __init__(self, config, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        layers, kv_heads, head_dim = kv_shape(config)
        # zeros, not empty: masked positions are multiplied by 0 in attention, which must not meet inf or nan
        self.buffer = new_buffer((layers, 2, kv_heads, capacity, head_dim), dtype, device, zeroed=True)
        self.seq_len = 0

    @property
    def capacity(self) -> int:
        return self.buffer.shape[3]


class _Slots:
    """One pass's caches as transformers' forward sees a cache: batch row b writes its K/V into ``caches[b]`` from
    ``starts[b]`` on, and every row attends over its whole buffer (the mask picks its positions)."""

    def __init__(self, caches: list[StaticKVCache], starts: list[int]):
        self.caches, self.starts = caches, starts

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        n = key_states.shape[-2]  # key_states: [slots, kv_heads, n, head_dim]
        for b, (cache, start) in enumerate(zip(self.caches, self.starts)):
            cache.buffer[layer_idx, 0, :, start : start + n] = key_states[b]
            cache.buffer[layer_idx, 1, :, start : start + n] = value_states[b]
        if len(self.caches) == 1:  # a view, no copy
            return self.caches[0].buffer[layer_idx, 0][None], self.caches[0].buffer[layer_idx, 1][None]
        return (torch.stack([c.buffer[layer_idx, 0] for c in self.caches]),  # [slots, kv_heads, capacity, head_dim]
                torch.stack([c.buffer[layer_idx, 1] for c in self.caches]))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.starts[0]


class BatchInvariantRunner(ModelRunner):
    """transformers' forward over ``StaticKVCache``s: chunks of up to ``rows`` tokens run in passes of ``slots``
    sequences x ``rows`` rows (sequences and rows padded), so every such pass has one shape.

    ``slots`` > 1 (a GPU verifier under load): concurrent sessions share a pass, each weight read once for all
    of them, and a session's logits are the same bits whether its slot's neighbours are sessions or padding.
    """

    def __init__(self, loaded, *, capacity: int | None = None, rows: int = PASS_ROWS, slots: int = 1):
        super().__init__(loaded)
        if not supports(loaded.config):
            raise ValueError(f"{loaded.model_id}: its attention layers do not fit a static KV buffer")
        if slots < 1:
            raise ValueError(f"a pass has at least one slot, got {slots}")
        self.rows, self.slots = rows, slots
        self.max_positions = capacity or loaded.max_context  # the longest sequence a session holds
        # room for the last pass's padding past it, rounded up to a multiple of CAPACITY_ALIGN (SDPA's fused kernels
        # want the mask's rows aligned)
        self.capacity = -(-(self.max_positions + rows) // CAPACITY_ALIGN) * CAPACITY_ALIGN
        self._spare: StaticKVCache | None = None  # what empty slots write to and read

    def new_cache(self) -> StaticKVCache:
        return StaticKVCache(self.model.config, self.capacity, self.model.dtype, self.device)

    def import_payload(self, payload: KVPayload) -> StaticKVCache:
        check_fingerprint(payload, self.loaded.fingerprint)
        cache = self.new_cache()
        n = payload.seq_len
        if len(payload.keys) != cache.buffer.shape[0]:
            raise InvalidRequestError(f"KV payload has {len(payload.keys)} layers, the model has {cache.buffer.shape[0]}")
        self._check_room(n, 0)
        cache.fill(payload)
        return cache

    def _check_room(self, start: int, n: int) -> None:
        if start + n > self.max_positions:
            raise InvalidRequestError(f"{start + n} positions do not fit this verifier's KV capacity of "
                                      f"{self.max_positions} (kv_capacity)")

    def forward(self, input_ids: torch.Tensor, cache: StaticKVCache, *, last_only: bool = False,
                return_features: bool = False):
        """As ``ModelRunner.forward``; a chunk of up to ``rows`` tokens runs in a pass of ``slots`` x ``rows``."""
        ((logits, features),) = self._run([(input_ids, cache)], [last_only], return_features)
        return (logits, features) if return_features else logits

    def _chunk_outputs(self, chunks, last: list[bool]):
        """``forward_batch``'s passes: short chunks ``slots`` at a time in one pass, longer ones alone."""
        return self._run(chunks, last, features=True)

    @torch.inference_mode()
    def _run(self, chunks: list[tuple[torch.Tensor, StaticKVCache]], last: list[bool], features: bool):
        """Per chunk (logits [n or 1, vocab_size] float32 on the host, features [n, hidden] or None)."""
        for ids, cache in chunks:  # before any pass writes: a chunk that does not fit fails the call alone
            self._check_room(cache.seq_len, ids.shape[0])
        outs: list = [None] * len(chunks)
        short = [i for i, (ids, _) in enumerate(chunks) if ids.shape[0] <= self.rows]
        for i, (ids, cache) in enumerate(chunks):
            if ids.shape[0] > self.rows:  # a prompt's length: a pass of its own shape
                outs[i] = self._pass([(ids, cache)], [last[i]], features, rows=ids.shape[0], slots=1)[0]
        for at in range(0, len(short), self.slots):
            group = short[at : at + self.slots]
            done = self._pass([chunks[i] for i in group], [last[i] for i in group], features, self.rows, self.slots)
            for i, out in zip(group, done):
                outs[i] = out
        return outs

    def _pass(self, chunks, last: list[bool], features: bool, rows: int, slots: int):
        """One forward of ``slots`` x ``rows``: chunk b in slot b (its rows padded with its last token), empty slots
        on a spare buffer."""
        ids = torch.zeros(slots, rows, dtype=torch.long)  # [slots, rows]
        caches, starts = [], []
        for b in range(slots):
            if b < len(chunks):
                chunk, cache = chunks[b]
                n = chunk.shape[0]
                ids[b, :n], ids[b, n:] = chunk, chunk[-1]
                caches.append(cache)
                starts.append(cache.seq_len)
            else:
                self._spare = self._spare or self.new_cache()
                caches.append(self._spare)
                starts.append(0)
        positions = (torch.tensor(starts)[:, None] + torch.arange(rows)[None]).to(self.device)  # [slots, rows]
        visible = torch.arange(self.capacity, device=self.device)[None, None] <= positions[:, :, None]  # [slots, rows, capacity]
        mask = torch.zeros(visible.shape, dtype=self.model.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.model.dtype).min)  # additive: eager and SDPA both take it
        # a padded pass computes every row's logits (one shape); a prompt's pass only its last row's if that is all
        last_row_only = rows > self.rows and last[0]
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask[:, None],  # [slots, 1, rows, capacity]: used as it is
            position_ids=positions,
            **{self._cache_kwarg: _Slots(caches, starts)},
            use_cache=True,
            logits_to_keep=1 if last_row_only else 0,
            output_hidden_states=features,
        )
        results = []
        for b, ((chunk, cache), only_last) in enumerate(zip(chunks, last)):
            n = chunk.shape[0]
            cache.seq_len = starts[b] + n
            logits = out.logits[b] if last_row_only else out.logits[b, :n]
            logits = (logits[-1:] if only_last else logits).float().cpu()  # [n or 1, vocab_size], for the sampler
            results.append((logits, out.hidden_states[-1][b, :n].cpu() if features else None))
        return results
