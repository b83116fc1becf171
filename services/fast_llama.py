"""A compact forward pass for Llama-architecture models (gpt-fast style).

transformers' forward is general; on a CPU at batch size 1 two things make it
slow for speculative decoding: weights kept as [out, in] (the GEMV path reads
them at half the bandwidth of an [in, out] layout) and small-M GEMMs for the
verify pass. This runner keeps each layer's weights fused (q|k|v in one
matrix, gate|up in another), a dense KV buffer that rolls back by moving a
length, and for each matmul the BLAS call that is fastest
for the chunk size (see ``Linear``). Numerics follow ``modeling_llama`` op for op (RMSNorm in float32,
rotate-half RoPE, SDPA); tests check logits against transformers.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from services import kernels
from services.draft_vocab import scatter_kept
from services.kv import KVPayload, as_tensor, check_fingerprint, new_buffer, to_numpy

INITIAL_CAPACITY = 256  # KV positions allocated up front; doubled as needed


class Linear:
    """One weight in the layouts its calls need; each chunk size takes the fastest call.

    ``kernels.skinny_gemm`` (where it is built, float32) takes every chunk of up to ``SKINNY_MAX_ROWS`` rows: it
    streams the weight once, packed into panels, for all the rows, as fast as the best BLAS call for one row and
    up to 1.5x faster for several (measured), and a row's result does not depend on the other rows, so batching
    sessions' verify chunks leaves each one's logits bit-identical. Longer chunks (prompts) take the BLAS GEMM
    with W^T stored [in, out]. Without the kernel, which BLAS call wins for a few rows depends on the BLAS, the CPU
    and the shape (for one row, ``x @ W^T`` with W^T stored [in, out] streams at about twice the bandwidth of W
    stored [out, in]; for a few rows MKL's small-M GEMM on AMD EPYC can be several times slower than
    ``(W @ x^T)^T``), so the first call of each (shape, rows) times the candidates and remembers the fastest.
    """

    _plans: dict[tuple[int, int, int, int], str] = {}  # (in, out, rows, threads) -> fastest variant
    forced_variant: str | None = None  # pin one variant for every call (bit-reproducible comparisons)

    def __init__(self, weight: torch.Tensor, storage: torch.dtype | None = None):  # [out, in]
        """``storage=torch.bfloat16`` (a drafter's float32 weights): the weight is rounded to bfloat16 once
        (``weights_as``) and the kernel streams it as bfloat16, half the bytes, widening each value as it loads it,
        products and sums in float32; every other call uses the same rounded values in float32."""
        if storage not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"a Linear's weights are stored as float32 or bfloat16, not {storage}")
        weight = weights_as(weight, storage)
        self.out_features = weight.shape[0]
        self.weight_t = weight.t().contiguous()  # [in, out]
        self.packed = None  # [panels, in, width]: the kernel's layout, where it is built (float32 weights)
        self.weight = None  # [out, in]: for the BLAS variants that only run without the kernel
        if weight.dtype == torch.float32 and weight.device.type == "cpu" and kernels.skinny_gemm() is not None:
            self.packed = kernels.pack_weight(weight, storage or torch.float32)  # (exact: the values are rounded)
        else:
            self.weight = weight.contiguous()

    def _row_major(self, x):
        return x @ self.weight_t

    def _col_major(self, x):
        return (self.weight @ x.t()).t().contiguous()

    def _skinny(self, x):
        return kernels.skinny_gemm()(x, self.packed, self.out_features)

    def _skinny_fits(self, n: int) -> bool:
        return n <= kernels.SKINNY_MAX_ROWS and self.packed is not None

    def variants(self, n: int) -> dict:
        found = {"row_major": self._row_major}
        if self.weight is not None:
            found["col_major"] = self._col_major
        if self._skinny_fits(n):
            found["skinny"] = self._skinny
        return found

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        n = x.shape[0]
        if Linear.forced_variant is not None:
            return getattr(self, "_" + Linear.forced_variant)(x)
        if self._skinny_fits(n):
            # batch-invariant: a row's product is the same bits whatever rows share the call (batched verify)
            return self._skinny(x)
        if n > AUTOTUNE_MAX_ROWS:
            return self._row_major(x)
        key = (*self.weight_t.shape, n, torch.get_num_threads())
        if key not in Linear._plans:  # plan once; later calls skip building the candidates
            variants = self.variants(n)
            Linear._plans[key] = min(variants, key=lambda name: _time(variants[name], x))
        return getattr(self, "_" + Linear._plans[key])(x)


def _packed(layers: list[tuple]) -> list[list[torch.Tensor]] | None:
    """Per layer ``[ln1, qkv, o, ln2, gate_up, down]`` with the projections packed (kernels.decoder_layers), or
    None where one is not (no kernel, or not float32 on the CPU)."""
    if any(linear.packed is None for layer in layers for linear in (layer[1], layer[2], layer[4], layer[5])):
        return None
    return [[ln1, qkv.packed, o.packed, ln2, gate_up.packed, down.packed] for ln1, qkv, o, ln2, gate_up, down in layers]


def weights_as(weight: torch.Tensor, storage: torch.dtype | None) -> torch.Tensor:
    """A float32 ``weight`` rounded to ``storage``'s precision (kept float32); anything else as it is."""
    if storage is None or weight.dtype != torch.float32:
        return weight
    return weight.to(storage).to(torch.float32)


AUTOTUNE_MAX_ROWS = 16  # verify chunks are short; prefill-sized chunks use the plain GEMM
AUTOTUNE_REPEATS = 5


def _time(fn, x) -> float:
    fn(x)  # warm up
    best = math.inf
    for _ in range(AUTOTUNE_REPEATS):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


def supports(config) -> bool:
    """Plain Llama: default RoPE, no biases, no sliding window, SiLU MLP."""
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    return (
        config.model_type == "llama"
        and rope.get("rope_type", "default") == "default"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and config.hidden_act == "silu"
    )


def batch_invariant(dtype: torch.dtype) -> bool:
    """Whether this forward's rows are batch-invariant in ``dtype``: in float32 where the kernels are built (the skinny
    matmul and the decode attention compute each row on its own); otherwise its BLAS calls and SDPA depend on the
    number of rows and keys, as transformers' forward does."""
    return dtype == torch.float32 and kernels.skinny_gemm() is not None and kernels.decode_attention() is not None


class DenseKVCache:
    """KV of one sequence in one buffer [layers, 2, kv_heads, capacity, head_dim]; crop moves a length."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = INITIAL_CAPACITY):
        self.buffer = new_buffer((num_layers, 2, num_kv_heads, capacity, head_dim), dtype)
        self.seq_len = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def reserve(self, length: int) -> None:
        capacity = self.buffer.shape[3]
        if length > capacity:
            new_capacity = max(length, 2 * capacity)
            grown = new_buffer((*self.buffer.shape[:3], new_capacity, self.buffer.shape[4]), self.buffer.dtype,
                               self.buffer.device)  # (inside a forward pass too: a normal tensor)
            grown[:, :, :, : self.seq_len] = self.buffer[:, :, :, : self.seq_len]
            self.buffer = grown

    def fill(self, payload: KVPayload) -> None:
        """Take a payload's K/V as positions 0 .. seq_len (the buffer holds at least that many)."""
        # four torch calls (a stack and a copy for keys, the same for values), not two per layer: each call from
        # Python may wait for the GIL, which the replica's event loop holds while it serves the other sessions' streams
        n = payload.seq_len
        self.buffer[:, 0, :, :n] = torch.stack([as_tensor(k, payload.dtype) for k in payload.keys]).to(self.buffer.device)  # [layers, kv_heads, n, head_dim]
        self.buffer[:, 1, :, :n] = torch.stack([as_tensor(v, payload.dtype) for v in payload.values]).to(self.buffer.device)
        self.seq_len = n

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot crop a cache of {self.seq_len} positions to {length}")
        self.seq_len = length

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep positions ``start + r`` for r in ``rows`` (ascending, r >= its index) as positions start, start + 1, ..
        and crop after them: a draft tree's accepted path becomes the sequence."""
        for j, r in enumerate(rows):
            if r != j:
                self.buffer[:, :, :, start + j] = self.buffer[:, :, :, start + r]
        self.crop(start + len(rows))

    def export(self, fingerprint: str) -> KVPayload:
        view = self.buffer[:, :, :, : self.seq_len]  # [layers, 2, kv_heads, seq_len, head_dim]
        keys = [to_numpy(view[i, 0]) for i in range(view.shape[0])]
        values = [to_numpy(view[i, 1]) for i in range(view.shape[0])]
        dtype = str(self.buffer.dtype).removeprefix("torch.")
        return KVPayload(keys=keys, values=values, seq_len=self.seq_len, fingerprint=fingerprint, dtype=dtype)


class FastLlamaRunner:
    """Forward passes of a Llama model against ``DenseKVCache``s (same interface as ``ModelRunner``)."""

    supports_trees = True  # forward_batch takes draft trees (services.tree)
    # a constrained greedy row may take ``argmax``, then, where the grammar forbids it, its allowed ids' logits
    # (``head_logits_at``, where they are few) or ``head_logits`` (services.constraint.masked_argmax)
    screens_masked_rows = True
    fused = True  # short chunks through kernels.decoder_layers where it is built (False: the Python loop, same bits)

    def __init__(self, loaded, *, kept_ids: torch.Tensor | None = None, weight_storage: torch.dtype | None = None):
        # kept_ids: [N] ascending, None = full head; weight_storage: of the matmul weights (Linear), None = as loaded
        self.loaded = loaded
        model, config = loaded.model, loaded.model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.dtype = model.dtype
        base = model.model
        self.embed = base.embed_tokens.weight  # [vocab_size, hidden]
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), weight_storage),  # hidden -> (h + 2 h_kv) * d
                    Linear(attn.o_proj.weight, weight_storage),  # h * d -> hidden
                    layer.post_attention_layernorm.weight,
                    Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), weight_storage),  # hidden -> 2 * inter
                    Linear(mlp.down_proj.weight, weight_storage),  # inter -> hidden
                )
            )
        self.norm = base.norm.weight
        head = model.get_output_embeddings().weight  # [vocab_size, hidden]
        self.vocab_size = head.shape[0]
        self.kept_ids = kept_ids  # pruned draft vocabulary (services.draft_vocab), None = every id
        self.head = Linear(head if kept_ids is None else head[kept_ids], weight_storage)  # hidden -> N kept ids (or vocab_size)
        self.scaling = self.head_dim**-0.5
        self.packed_layers = _packed(self.layers)  # for kernels.decoder_layers (None: a projection is not packed)
        self._screen: tuple | None = None  # for kernels.greedy_head (``argmax``): built on first use, () = none
        theta = config.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))

    def new_cache(self) -> DenseKVCache:
        return DenseKVCache(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype)

    def import_payload(self, payload: KVPayload) -> DenseKVCache:
        check_fingerprint(payload, self.loaded.fingerprint)
        cache = self.new_cache()
        cache.reserve(payload.seq_len)
        cache.fill(payload)
        return cache

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n] -> 2 x [n, d]
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _rotate(x, cos, sin):  # x: [heads, n, d]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [n]
        cache: DenseKVCache,
        *,
        last_only: bool = False,
        return_features: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [n, vocab_size] ([1, vocab_size] with last_only)
        """Next-token logits; with ``return_features`` also the final-norm output of every row, [n, hidden] (EAGLE's feature)."""
        x = self._layers([(input_ids, cache)])  # [n, hidden]
        if last_only and not return_features:
            x = x[-1:]  # only the last row is needed
        features = self._rms_norm(x, self.norm)  # [m, hidden]: the final-norm output (EAGLE's feature)
        logits = self._head(features[-1:] if last_only else features)  # [1 or n, vocab_size]
        return (logits, features) if return_features else logits

    @torch.inference_mode()
    def forward_batch(
        self,
        chunks: list[tuple[torch.Tensor, DenseKVCache]],  # per sequence: its new tokens [n_i] and its own KV
        *,
        last_only: bool | list[bool] = False,
        trees: list | None = None,  # per chunk: a services.tree.DraftTree over its rows, or None (a sequence)
        greedy: list[bool] | None = None,  # per chunk: its argmax ids [n_i or 1] instead of its logits
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # per sequence: logits [n_i or 1, vocab_size], features [n_i, hidden]
        """One pass over several sequences' chunks (ragged rows): every weight is read once for all of them (for each
        group of up to ``SKINNY_MAX_ROWS`` rows: ``kernels.row_groups``).

        Each sequence attends only to its own KV; a row's logits are what ``forward`` gives for its chunk alone, the
        same bits however many rows the pass has.
        ``last_only``: logits of each chunk's last row only (prefill); a list: per chunk. A chunk with a tree: each row attends to the
        cached KV and its own ancestors, at the position of its depth (its K/V are appended in row order; keep the
        accepted path with ``DenseKVCache.keep``). ``greedy``: those chunks get the argmax of each row's logits
        through ``argmax`` (cheaper than the logits: ``kernels.greedy_head``): the ids of ``logits.argmax(-1)`` for
        passes of up to ``SKINNY_MAX_ROWS`` head rows; beyond, the greedy rows' logits and the others' are computed
        apart (a BLAS GEMM over many rows may round a near-tie otherwise than over some of them).
        """
        sizes = [ids.shape[0] for ids, _ in chunks]
        last = last_only if isinstance(last_only, list) else [last_only] * len(chunks)
        if len(groups := kernels.row_groups(sizes)) > 1:  # over SKINNY_MAX_ROWS rows: group by group (row_groups)
            out_logits, out_features = [None] * len(chunks), [None] * len(chunks)
            for group in groups:
                pick = lambda values: None if values is None else [values[i] for i in group]  # noqa: E731
                logits, features = self.forward_batch([chunks[i] for i in group], last_only=pick(last),
                                                      trees=pick(trees), greedy=pick(greedy))
                for i, chunk_logits, chunk_features in zip(group, logits, features):
                    out_logits[i], out_features[i] = chunk_logits, chunk_features
            return out_logits, out_features
        features = self._rms_norm(self._layers(chunks, trees), self.norm)  # [N, hidden], N = sum(sizes)
        per_chunk = list(features.split(sizes))
        head_sizes = [1 if flag else size for flag, size in zip(last, sizes, strict=True)]
        head_rows = torch.cat([f[-1:] if flag else f for f, flag in zip(per_chunk, last)]) if any(last) else features  # [sum(head_sizes), hidden]
        if not greedy or not any(greedy):
            return list(self._head(head_rows).split(head_sizes)), per_chunk
        if len(greedy) != len(chunks):
            raise ValueError(f"greedy has {len(greedy)} flags for {len(chunks)} chunks")
        wants_ids = torch.tensor([flag for flag, size in zip(greedy, head_sizes) for _ in range(size)])  # [rows]
        ids = self.argmax(head_rows[wants_ids]) if bool(wants_ids.any()) else None  # [greedy rows]
        logits = self._head(head_rows[~wants_ids]) if not bool(wants_ids.all()) else None  # [other rows, vocab_size]
        out, taken = [], {True: 0, False: 0}
        for flag, size in zip(greedy, head_sizes):
            source = ids if flag else logits
            out.append(source[taken[flag] : taken[flag] + size])
            taken[flag] += size
        return out, per_chunk

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:  # [m, hidden] -> [m, vocab_size] float32
        """The logits of final-norm features (forward_batch's), the same bits as the pass gives each row."""
        return self._head(features)

    def head_logits_at(self, features: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:  # [m, hidden], [a] -> [m, a]
        """``head_logits(features)[:, token_ids]``, the same bits, from those ids' weights alone where the kernel
        computes the head (``kernels.skinny_gemm`` computes each output on its own: from 0, one fused multiply-add per
        input, in order, whatever outputs share the call); a masked argmax over a few allowed ids
        (services.constraint.masked_argmax) then costs a few of the head's 49k dot products."""
        if (self.head.packed is None or self.kept_ids is not None or Linear.forced_variant is not None
                or features.shape[0] > kernels.SKINNY_MAX_ROWS):
            return self.head_logits(features)[:, token_ids]
        weight = self.head.weight_t[:, token_ids].t()  # [a, hidden]
        return kernels.skinny_gemm()(features, kernels.pack_weight(weight, self.head.packed.dtype), len(token_ids)).float()

    def _head(self, features: torch.Tensor) -> torch.Tensor:  # [m, hidden] -> [m, vocab_size] float32
        logits = self.head(features).float()  # [m, N kept or vocab_size]
        return logits if self.kept_ids is None else scatter_kept(logits, self.kept_ids, self.vocab_size)

    def argmax(self, features: torch.Tensor) -> torch.Tensor:  # [m, hidden] -> [m] token ids
        """``self._head(features).argmax(-1)``, the same ids: where the head's logits would come from
        ``kernels.skinny_gemm`` (float32, at most ``SKINNY_MAX_ROWS`` rows, the full vocabulary), through
        ``kernels.greedy_head`` (a bfloat16 screen with an error bound, the exact logits of its few candidates:
        2.6x faster for one row, 1.7x for 32, measured here); a row it cannot take (a value that is not finite)
        through its logits."""
        screen = self._greedy_screen() if features.shape[0] <= kernels.SKINNY_MAX_ROWS else None
        if screen is None or Linear.forced_variant is not None:
            return self._head(features).argmax(-1)
        ids, _ = kernels.greedy_head()(features.float(), *screen, self.head.out_features)  # [m], [m] candidates
        if bool((missing := ids < 0).any()):
            ids[missing] = self._head(features[missing]).argmax(-1)
        return ids

    def _greedy_screen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(screen, packed head, row norms) for ``kernels.greedy_head``, built on first use (the screen holds the
        head once more, as bfloat16), or None where it does not apply."""
        if self._screen is None:
            packed = self.head.packed
            usable = (self.kept_ids is None and packed is not None and packed.dtype == torch.float32
                      and kernels.greedy_head() is not None)
            weight = self.head.weight_t.t() if usable else None  # [vocab_size, hidden]
            usable = usable and bool(torch.isfinite(weight).all())
            self._screen = (kernels.pack_screen(weight), packed, kernels.row_norms(weight)) if usable else ()
        return self._screen or None

    def _layers(self, chunks: list[tuple[torch.Tensor, DenseKVCache]], trees: list | None = None) -> torch.Tensor:  # -> [N, hidden] before the final norm
        """The decoder layers over the rows of every chunk; appends each chunk's K/V to its cache.

        A short chunk (``kernels.DECODE_ATTENTION_MAX_ROWS``: verify blocks, draft steps) attends through the
        compiled ``decode_attention``, all of them in one call per layer; a longer one (a prompt) through SDPA.
        Which path a chunk takes depends on its own length only, so batching never changes its result.
        """
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        attend = kernels.decode_attention() if self.dtype == torch.float32 else None
        spans = []  # per chunk taking SDPA: (row offset, rows, first position, its cache, its causal mask)
        short_caches, short_offsets, short_sizes, short_starts = [], [], [], []  # the chunks taking decode_attention
        short_parents = []  # per such chunk: its rows' parent rows if it is a draft tree, else []
        positions = []  # per chunk: its rows' positions
        offset = 0
        for c, (input_ids, cache) in enumerate(chunks):
            n, start = input_ids.shape[0], cache.seq_len
            cache.reserve(start + n)
            tree = trees[c] if trees is not None else None
            # a tree's rows sit at their depth's position, each seeing the cache and its ancestors
            positions.append(start + torch.tensor(tree.depths()) if tree is not None else torch.arange(start, start + n))
            if attend is not None and n <= kernels.DECODE_ATTENTION_MAX_ROWS:
                short_caches.append(cache.buffer)
                short_offsets.append(offset)
                short_sizes.append(n)
                short_starts.append(start)
                short_parents.append([-1, *tree.parents] if tree is not None else [])
            else:
                mask = None
                if tree is not None:
                    mask = torch.cat([torch.ones(n, start, dtype=torch.bool), tree.ancestors()], dim=1)  # [n, start + n]
                elif n > 1:  # causal over the new positions; all cached positions visible
                    mask = torch.ones(n, start + n, dtype=torch.bool).tril_(diagonal=start)
                spans.append((offset, n, start, cache, mask))
            offset += n
        total = offset
        cos, sin = self._rope(torch.cat(positions))  # [N, d]
        x = F.embedding(torch.cat([ids for ids, _ in chunks]), self.embed)  # [N, hidden]
        layers = kernels.decoder_layers() if self.fused and attend is not None and not spans else None
        if layers is not None and self.packed_layers is not None and total <= kernels.SKINNY_MAX_ROWS \
                and Linear.forced_variant is None:
            # every chunk is short: the loop below in C++, one call without the GIL (csrc/decoder_layers.cpp)
            x = layers(x, self.packed_layers, cos, sin, self.eps, h, h_kv, d, self.layers[0][4].out_features // 2,
                       short_caches, short_offsets, short_sizes, short_starts, self.scaling, short_parents)
            for input_ids, cache in chunks:
                cache.seq_len += input_ids.shape[0]
            return x
        for i, (ln1, w_qkv, w_o, ln2, w_gu, w_down) in enumerate(self.layers):
            qkv = w_qkv(self._rms_norm(x, ln1))  # [N, (h + 2 h_kv) * d]
            q = qkv[:, : h * d].view(total, h, d).transpose(0, 1)  # [h, N, d]
            k = qkv[:, h * d : (h + h_kv) * d].view(total, h_kv, d).transpose(0, 1)  # [h_kv, N, d]
            v = qkv[:, (h + h_kv) * d :].view(total, h_kv, d).transpose(0, 1)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            out = x.new_empty(total, h * d)  # [N, h * d]: every chunk's attention output
            if short_caches:
                attend(out, q, k, v, short_caches, short_offsets, short_sizes, short_starts, i, self.scaling,
                       short_parents)
            for offset, n, start, cache, mask in spans:
                end = start + n
                cache.buffer[i, 0, :, start:end] = k[:, offset : offset + n]
                cache.buffer[i, 1, :, start:end] = v[:, offset : offset + n]
                keys = cache.buffer[i, 0, :, :end]  # [h_kv, end, d]
                values = cache.buffer[i, 1, :, :end]
                attn = F.scaled_dot_product_attention(
                    q[None, :, offset : offset + n], keys[None], values[None], attn_mask=mask, scale=self.scaling,
                    enable_gqa=True,
                )  # [1, h, n, d]
                out[offset : offset + n] = attn[0].transpose(0, 1).reshape(n, h * d)
            x = x + w_o(out)
            gate, up = w_gu(self._rms_norm(x, ln2)).chunk(2, dim=-1)  # 2 x [N, inter]
            x = x + w_down(F.silu(gate) * up)
        for input_ids, cache in chunks:
            cache.seq_len += input_ids.shape[0]
        return x
