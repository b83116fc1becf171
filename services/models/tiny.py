"""A tiny randomly initialised target/draft pair for fast tests.

Losslessness does not depend on trained weights, so the engine's exactness
is tested on this pair in milliseconds. The drafter is derived from the
target the way the default drafter is: its first layers, shared embeddings.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.loading import LoadedModel, wrap_model

TINY_VOCAB_SIZE = 96
TINY_TARGET_LAYERS = 4
TINY_DRAFT_LAYERS = 1
# A wide init makes next-token distributions peaked, so greedy argmaxes are
# far from ties and float rounding cannot flip them.
TINY_INIT_STD = 0.25
TINY_EOS = 3


def tiny_config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=TINY_INIT_STD,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
    )


def tiny_pair(seed: int = 0) -> tuple[LoadedModel, LoadedModel]:
    """(target, draft), both built from fixed-seed configs."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(tiny_config(TINY_TARGET_LAYERS)).float()
    draft = LlamaForCausalLM(tiny_config(TINY_DRAFT_LAYERS)).float()
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")}
    for i in range(TINY_DRAFT_LAYERS):
        prefix = f"model.layers.{i}."
        state.update({k: v for k, v in target.state_dict().items() if k.startswith(prefix)})
    draft.load_state_dict(state, strict=False)
    return wrap_model(target, model_id=f"tiny-target-{seed}"), wrap_model(draft, model_id=f"tiny-draft-{seed}")
