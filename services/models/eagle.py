"""An EAGLE-style drafter: a one-layer head that reads the target's features.

EAGLE (arXiv 2401.15077) drafts at the feature level: from the target's
feature f_t at position t and the embedding of the next token x_{t+1}, one
decoder layer predicts the next feature, and the target's LM head turns it
into a token. Chain drafting feeds the predicted feature back. EAGLE-3
(arXiv 2503.01840) fuses low, mid and high-layer features and trains on its
own chained predictions ("training-time test"); both are here:

    g_t   = W_in f_t                          target feature (``final``: final-norm output, or ``fused``: 3 layers)
    z_t   = W_fc [norm(g_t) ; norm(E x_{t+1})]
    h_t   = DecoderLayer(z_≤t)                attends over the accepted context's z
    q_t   = softmax(E_kept norm_out(h_t))     draft distribution over the kept ids (FR-Spec, arXiv 2502.14856)
    g_t+1 = W_in norm_out(h_t)  (final)  |  h_t  (fused, as EAGLE-3)   fed back for the next draft token

Embeddings and LM-head rows are the target's, frozen; only the head trains
(soft cross-entropy to the target's top-K + smooth-L1 to the target's next
feature: services.training.eagle_train). ``chain`` runs s = 1..S draft steps
from every start position at once: step s at row t attends to the context's
keys up to t and to its own chain's keys (steps 2..s), exactly what drafting
from t sees. Drafting one sequence at a time, batched over sessions, is
``HeadSession`` and ``run_rows`` (services.eagle_draft serves them).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services import kernels
from services.drafters import drive
from services.kv import new_buffer

NO_ID = -1  # remap entry of a vocabulary id outside the kept draft vocabulary


@dataclass(frozen=True)
class EagleConfig:
    feature: str = "final"  # "final" (EAGLE) or "fused" (EAGLE-3 low/mid/high)
    draft_vocab: int = 16384  # kept ids: the most frequent in the target's training answers (0 = all)
    ttt_steps: int = 3  # chain steps unrolled in training
    reg_weight: float = 0.5  # smooth-L1 feature regression, beside the cross-entropy
    epochs: int = 1
    batch_size: int = 4  # sequences per optimiser step
    lr: float = 1e-3
    warmup_steps: int = 10
    seed: int = 0
    num_threads: int = 1


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight.clone().float()), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class EagleHead(nn.Module):
    def __init__(self, target, cfg: EagleConfig, kept_ids: torch.Tensor, feature_dim: int):
        super().__init__()
        c = target.config
        h, eps = c.hidden_size, c.rms_norm_eps
        self.cfg, self.feature_dim = cfg, feature_dim
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or h // self.num_heads
        self.inv_freq = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        embed = target.model.embed_tokens.weight.detach().float()
        self.register_buffer("embed", embed, persistent=False)  # [vocab_size, h], frozen
        self.register_buffer("kept_ids", kept_ids.long())  # [N]
        self.register_buffer("remap", _remap(kept_ids, embed.shape[0]), persistent=False)  # [vocab_size]
        ones = torch.ones(h)
        self.feature_in = nn.Linear(feature_dim, h, bias=False)
        self.norm_feat, self.norm_emb = RMSNorm(ones, eps), RMSNorm(ones, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        last = target.model.layers[-1]  # q/k/v and the MLP's input projections start from the target's last layer
        attn, mlp = last.self_attn, last.mlp
        self.ln1, self.ln2 = RMSNorm(last.input_layernorm.weight.detach(), eps), RMSNorm(last.post_attention_layernorm.weight.detach(), eps)
        self.wq, self.wk, self.wv, self.wo = (_linear(m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.w_gate, self.w_up, self.w_down = (_linear(m.weight) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.norm_out = RMSNorm(ones, eps)  # unit scale at first: the target's norm weights on z give CE ~70
        with torch.no_grad():  # start as "h_out = z": output projections at zero, fc averages its two inputs
            self.wo.weight.zero_()
            self.w_down.weight.zero_()
            eye = torch.eye(h)
            self.fc.weight.copy_(torch.cat([eye, eye], dim=1) * 0.5)
            if feature_dim == h:
                self.feature_in.weight.copy_(eye)

    def rope(self, positions: torch.Tensor):  # [..., L] -> cos, sin [..., L, d]
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def rotate(x, cos, sin):  # x: [B, heads, L, d]; cos/sin: [B, 1, L, d]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def inputs(self, g: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [B, L, h], [B, L] -> z [B, L, h]
        return self.fc(torch.cat([self.norm_feat(g), self.norm_emb(self.embed[tokens])], dim=-1))

    def qkv(self, z, positions):  # z: [B, L, h] -> q [B, H, L, d], k/v [B, H_kv, L, d]
        B, L, _ = z.shape
        a = self.ln1(z)
        q = self.wq(a).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.wk(a).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(a).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions)
        return self.rotate(q, cos[:, None], sin[:, None]), self.rotate(k, cos[:, None], sin[:, None]), v

    def finish(self, z, attn, rows=None):  # z: [B, L, h], attn: [B, H, L, d] -> h_out [B, L, h]
        """The output projection and MLP; with ``rows`` [B, L] (bool) of those rows only (the others keep z)."""
        B, L, _ = z.shape
        a = attn.transpose(1, 2).reshape(B, L, -1)  # [B, L, H d]
        if rows is None:
            return self._out(z, a)
        return z.index_put((rows,), self._out(z[rows], a[rows]))

    def _out(self, z, a):  # z: [..., h], a: [..., H d] -> [..., h]
        x = z + self.wo(a)
        return x + self.w_down(F.silu(self.w_gate(self.ln2(x))) * self.w_up(self.ln2(x)))

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., N] over kept ids
        return self.norm_out(h_out) @ self.embed[self.kept_ids].t()

    def feedback(self, h_out: torch.Tensor) -> torch.Tensor:  # the next step's g
        return self.feature_in(self.norm_out(h_out)) if self.cfg.feature == "final" else h_out

    def chain(self, features, tokens, steps: int, *, teacher_tokens: bool, rows: torch.Tensor | None = None):
        """Draft ``steps`` tokens from every start row at once.

        features: [B, L, feature_dim] target features at positions 0..L-1;
        tokens:   [B, L + steps] token ids (x_1.. : row t's step s reads x_{t+s}).
        Returns per step h_out [B, L, h] and, without ``teacher_tokens``, the
        drafted ids [B, L] (argmax over the kept ids, fed to the next step);
        with ``teacher_tokens`` step s > 1 reads the true x_{t+s} instead.
        rows: [B, L] bool, the rows whose outputs the caller reads (training: those with a loss at some step); the
        others' output projection and MLP are skipped (their h_out is garbage). Exact for the rows read: a row's
        chain reads only step 0's keys and values (every row's, always computed) and its own earlier steps.
        """
        B, L, _ = features.shape
        rep = self.num_heads // self.num_kv_heads
        positions = torch.arange(L).expand(B, L)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        g, step_tokens = self.feature_in(self.prepare(features)), tokens[:, :L]
        ctx_k = ctx_v = None
        diag_k, diag_v, out, drafted = [], [], [], []
        for s in range(steps):
            z = self.inputs(g, step_tokens)
            q, k, v = self.qkv(z, positions + s)
            if s == 0:
                ctx_k, ctx_v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, H, L, d]
            else:
                diag_k.append(k.repeat_interleave(rep, 1))
                diag_v.append(v.repeat_interleave(rep, 1))
            scores = (q @ ctx_k.transpose(-1, -2)).masked_fill(~causal, -math.inf)  # [B, H, L, L]
            diag = [(q * dk).sum(-1, keepdim=True) for dk in diag_k]  # each [B, H, L, 1]
            p = torch.softmax(torch.cat([scores, *diag], dim=-1) / math.sqrt(self.head_dim), dim=-1)
            attn = p[..., :L] @ ctx_v + sum(p[..., L + r, None] * dv for r, dv in enumerate(diag_v))
            h_out = self.finish(z, attn, rows)
            out.append(h_out)
            if not teacher_tokens:
                drafted.append(self.kept_ids[self.logits(h_out).argmax(-1)])
            if s + 1 < steps:
                g = self.feedback(h_out)
                step_tokens = tokens[:, s + 1 : s + 1 + L] if teacher_tokens else drafted[-1]
        return out, drafted

    def prepare(self, features: torch.Tensor) -> torch.Tensor:
        """Fused features: each layer's residual stream RMS-normalised (their scales differ by orders)."""
        if self.cfg.feature != "fused":
            return features
        parts = features.float().unflatten(-1, (-1, self.norm_out.weight.shape[0]))
        return (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k != "kept_ids"}


def with_vocabulary(head: EagleHead, ranked_ids, size: int) -> EagleHead:
    """``head`` proposing only the ``size`` of its kept ids that ``ranked_ids`` (a draft vocabulary's ranking,
    services.draft_vocab: most frequent first) ranks highest — its ids absent from the ranking last, by id: its LM
    head shrinks to those rows, the bytes a draft token streams with it. The weights are shared and ``head`` is
    left as it is. Lossless like any pruning: q is zero outside the kept ids and the verifier accepts by q."""
    own = set(head.kept_ids.tolist())
    if size >= len(own):
        return head
    if size < 1:
        raise ValueError(f"an EAGLE head keeps at least one id, got {size}")
    order = [i for i in ranked_ids if i in own]
    order += sorted(own.difference(order))
    kept = torch.tensor(sorted(order[:size]), dtype=torch.long)  # [size] ascending, as the head's own
    pruned = copy.copy(head)  # (nn.Module: the same parameters and submodules)
    pruned._buffers = dict(head._buffers)
    pruned.__dict__.pop("_linears", None)  # (HeadLinears.of makes the pruned head's own)
    pruned.kept_ids = kept
    pruned.remap = _remap(kept, len(head.remap))
    return pruned


def _remap(kept_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [N] -> [vocab_size]
    """Each vocabulary id's index among ``kept_ids``, NO_ID for the ids the head does not keep."""
    remap = torch.full((vocab_size,), NO_ID, dtype=torch.long)
    remap[kept_ids] = torch.arange(len(kept_ids))
    return remap


def save_head(head: EagleHead, path, dtype: torch.dtype = torch.bfloat16):
    """What ``load_head`` reads, at ``path`` (safetensors): the trained weights in ``dtype`` (bfloat16: what serving
    reads; float32: a trainer's checkpoint), the kept ids and the config. Not the target's frozen parts."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.trainable_state().items()}
    state["kept_ids"] = head.kept_ids.int().cpu().contiguous()
    save_file(state, str(path), metadata={"config": json.dumps(dataclasses.asdict(head.cfg))})
    return path


def head_config(path) -> EagleConfig:
    """A saved head's config (``save_head`` keeps it in the file's metadata), without reading its weights."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return EagleConfig(**json.loads(f.metadata()["config"]))


def load_head(target, path) -> EagleHead:
    """A saved head (``save_head``) on ``target``'s frozen embeddings and LM-head rows."""
    from safetensors.torch import load_file

    cfg = head_config(path)
    state = load_file(path)
    kept = state.pop("kept_ids").long()
    head = EagleHead(target, cfg, kept, state["feature_in.weight"].shape[1])
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return head.eval().requires_grad_(False)


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight.detach().float())
    return layer


# ---- inference (one sequence, KV cache) -------------------------------------------------------------


@dataclass(frozen=True)
class HeadLinears:
    """The head's matmuls as fast_llama.Linear (the skinny kernel where built: a row's result does not depend on
    the other rows of its call, so sessions batched into one pass draft what they draft alone), made once per head."""

    feature_in: object
    fc: object
    qkv: object  # q | k | v
    o: object
    gate_up: object
    down: object
    lm_head: object  # the target's embedding rows of the kept ids, [N, h]

    @staticmethod
    def of(head: EagleHead, storage: torch.dtype | None = None) -> "HeadLinears":
        """The head's linears, made on first call with ``storage`` (fast_llama.Linear: torch.bfloat16 streams half
        the bytes; None = the weights' own dtype); later calls return them as made."""
        from services.fast_llama import Linear

        cached = getattr(head, "_linears", None)
        if cached is None:
            w = lambda lin: lin.weight.detach()  # noqa: E731  [out, in]
            linear = lambda weight: Linear(weight, storage)  # noqa: E731
            cached = HeadLinears(
                linear(w(head.feature_in)), linear(w(head.fc)), linear(torch.cat([w(head.wq), w(head.wk), w(head.wv)])),
                linear(w(head.wo)), linear(torch.cat([w(head.w_gate), w(head.w_up)])), linear(w(head.w_down)),
                linear(head.embed[head.kept_ids]),
            )
            object.__setattr__(head, "_linears", cached)  # not a parameter or buffer
        return cached


@dataclass
class Rows:
    """One session's rows of a head pass (``run_rows`` batches several sessions' rows into one)."""

    session: "HeadSession"
    g: torch.Tensor  # [n, h] the features fed with the tokens
    tokens: torch.Tensor  # [n] the tokens
    start: int  # position of the first row: its K/V go to start .. start + n
    extend: bool  # accepted context rows (``extend_rows``) or one chain row (``chain_rows``)


def _norm(x, norm: RMSNorm):
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


@torch.inference_mode()
def run_rows(batch: list[Rows]) -> list[torch.Tensor]:
    """One pass of the head over the rows of several sessions (ragged, each attending to its own K/V): every
    weight is read once for all of them (for each group of up to ``SKINNY_MAX_ROWS`` rows: ``kernels.row_groups``,
    so a session's logits are the same bits however many rows share its pass). Returns each session's logits over
    the kept ids for its last row, [N], and moves each session on (its context or chain grows, its next feature is
    set)."""
    groups = kernels.row_groups([len(r.tokens) for r in batch])
    if len(groups) > 1:
        out = [None] * len(batch)
        for group in groups:
            for i, logits in zip(group, _run_group([batch[i] for i in group])):
                out[i] = logits
        return out
    return _run_group(batch)


def _run_group(batch: list[Rows]) -> list[torch.Tensor]:
    head = batch[0].session.head
    lin = HeadLinears.of(head)
    H, Hk, d = head.num_heads, head.num_kv_heads, head.head_dim
    sizes = [len(r.tokens) for r in batch]
    n_rows = sum(sizes)
    g = torch.cat([r.g for r in batch])  # [R, h]
    tokens = torch.cat([r.tokens for r in batch]).long()  # [R]
    z = lin.fc(torch.cat([_norm(g, head.norm_feat), _norm(head.embed[tokens], head.norm_emb)], -1))  # [R, h]
    qkv = lin.qkv(_norm(z, head.ln1))  # [R, (H + 2 Hk) d]
    cos, sin = head.rope(torch.cat([torch.arange(r.start, r.start + n) for r, n in zip(batch, sizes)]))  # [R, d]
    q = head.rotate(qkv[:, : H * d].view(n_rows, H, d).transpose(0, 1), cos, sin)  # [H, R, d]
    k = head.rotate(qkv[:, H * d : (H + Hk) * d].view(n_rows, Hk, d).transpose(0, 1), cos, sin)  # [Hk, R, d]
    v = qkv[:, (H + Hk) * d :].view(n_rows, Hk, d).transpose(0, 1)  # [Hk, R, d]
    attn = torch.empty(n_rows, H * d)
    offset = 0
    for r, n in zip(batch, sizes):  # each session attends to its own context and chain
        s, rows, end = r.session, slice(offset, offset + n), r.start + n
        s.k[:, r.start : end], s.v[:, r.start : end] = k[:, rows], v[:, rows]
        mask = torch.ones(n, end, dtype=torch.bool).tril_(diagonal=r.start) if n > 1 else None
        out = F.scaled_dot_product_attention(q[None, :, rows].contiguous(), s.k[None, :, :end], s.v[None, :, :end],
                                             attn_mask=mask, enable_gqa=True)[0]  # [H, n, d]
        attn[rows] = out.transpose(0, 1).reshape(n, H * d)
        offset += n
    x = z + lin.o(attn)
    gate, up = lin.gate_up(_norm(x, head.ln2)).chunk(2, dim=-1)
    h_out = x + lin.down(F.silu(gate) * up)  # [R, h]
    last = h_out[torch.tensor(sizes).cumsum(0) - 1]  # [B, h] each session's last row
    normed = _norm(last, head.norm_out)
    logits = lin.lm_head(normed)  # [B, N]
    g_next = lin.feature_in(normed) if head.cfg.feature == "final" else last  # [B, h] fed with the next token
    for i, r in enumerate(batch):
        r.session.moved(r, g_next[i : i + 1])
    return list(logits)


def run_alone(steps):
    """Drive a generator of ``Rows`` (a session's drafting, services.eagle_draft) one pass at a time; its result."""
    return drive(steps, lambda rows: run_rows([rows])[0])


class HeadSession:
    """Drafting with a trained head for one sequence: what a draft engine session would run.

    ``extend(features, tokens)`` appends accepted positions (the target's
    features f_a..f_t and the tokens x_{a+1}..x_{t+1}) and returns the first
    draft token; ``draft_one()`` chains the next one (``extend_logits`` /
    ``chain_logits``: the same with logits over the kept ids, for sampling); ``rollback()`` drops the chain
    so the next ``extend`` continues from the accepted context. ``extend_rows`` / ``chain_rows`` are the same
    steps as ``Rows`` for ``run_rows``, which runs several sessions' in one pass.
    """

    def __init__(self, head: EagleHead, capacity: int = 256):
        self.head = head
        self.k = new_buffer((head.num_kv_heads, capacity, head.head_dim), torch.float32, zeroed=True)
        self.v = new_buffer(tuple(self.k.shape), torch.float32, zeroed=True)
        self.length = 0  # accepted context rows
        self.chain_len = 0
        self.g = self.last_token = None

    def _reserve(self, end: int) -> None:  # grow the K/V rows to hold ``end`` (doubling), keeping context and chain rows
        if end > self.k.shape[1]:
            size, used = max(end, 2 * self.k.shape[1]), self.length + self.chain_len
            shape = (self.k.shape[0], size, self.k.shape[2])
            k, v = new_buffer(shape, self.k.dtype, zeroed=True), new_buffer(shape, self.v.dtype, zeroed=True)
            k[:, :used], v[:, :used] = self.k[:, :used], self.v[:, :used]
            self.k, self.v = k, v

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @torch.inference_mode()
    def extend_rows(self, features: torch.Tensor, tokens: torch.Tensor) -> Rows:  # [n, F], [n]
        """Append accepted positions (the chain is dropped); their pass gives the logits of the first draft token."""
        self._reserve(self.length + len(tokens) + 1)
        g = HeadLinears.of(self.head).feature_in(self.head.prepare(features.float()))  # [n, h]
        return Rows(self, g, tokens.long(), self.length, extend=True)

    def chain_rows(self, token: int) -> Rows:
        """Feed a draft token back; its pass gives the logits of the next one."""
        self._reserve(self.length + self.chain_len + 2)
        return Rows(self, self.g, torch.tensor([int(token)]), self.length + self.chain_len, extend=False)

    def moved(self, rows: Rows, g_next: torch.Tensor) -> None:
        """``rows`` ran (run_rows): the context or the chain grew; ``g_next`` [1, h] goes with the next token."""
        if rows.extend:
            self.length += len(rows.tokens)
            self.chain_len = 0
        else:
            self.chain_len += 1
        self.g = g_next

    def extend_logits(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [n, F], [n] -> [N]
        """Append accepted positions; the logits of the first draft token (over the kept ids)."""
        return run_rows([self.extend_rows(features, tokens)])[0]

    def chain_logits(self, token: int) -> torch.Tensor:  # -> [N]
        """Feed a draft token back; the logits of the next one."""
        return run_rows([self.chain_rows(token)])[0]

    def extend(self, features: torch.Tensor, tokens: torch.Tensor) -> int:  # [n, F], [n]
        self.last_token = int(self.head.kept_ids[self.extend_logits(features, tokens).argmax()])
        return self.last_token

    def draft_one(self) -> int:
        """The next chained draft token (after ``extend`` gave the first)."""
        self.last_token = int(self.head.kept_ids[self.chain_logits(self.last_token).argmax()])
        return self.last_token

    def rollback(self) -> None:
        self.chain_len = 0
