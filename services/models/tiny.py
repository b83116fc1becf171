"""A tiny randomly initialised target/draft pair for fast tests.

Losslessness does not depend on trained weights, so the engine's exactness
is tested on this pair in milliseconds. The drafter is derived from the
target the way the default drafter is: its first layers, shared embeddings.
"""

from __future__ import annotations

import shutil
from pathlib import Path

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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
EMBEDDING_STD = 1.0  # the tied LM head's rows: logits spread over tens, so near-ties are rare in bfloat16


def random_pair(out: Path, tokenizer: Path, shape: str, seed: int = 0) -> tuple[Path, Path]:
    """(target, draft) folders of random-weight Llama models around ``tokenizer``'s files (a prepared target's):
    ``shape`` "default" (the default target's architecture) or "small" (4 layers of 64); the draft is the target's
    first half of its layers with its embeddings (tied head) and final norm. What the GPU serve check serves and
    the drafter trainer's end-to-end test trains a head for."""
    from services.models import default_pair

    config = default_pair.architecture() if shape == "default" else LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        target.get_input_embeddings().weight.normal_(0.0, EMBEDDING_STD)
    draft_config = config.to_dict() | {"num_hidden_layers": max(1, config.num_hidden_layers // 2)}
    draft = LlamaForCausalLM(type(config).from_dict(draft_config)).to(torch.bfloat16)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()})
    folders = []
    for name, model in (("target", target), ("draft", draft)):
        folder = out / name
        model.save_pretrained(folder)
        for f in TOKENIZER_FILES:
            shutil.copy(tokenizer / f, folder / f)
        folders.append(folder)
    return folders[0], folders[1]
