"""Load Hugging Face causal LMs and check that a draft/target pair fits together."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoTokenizer

from services.errors import InvalidRequestError, ModelMismatchError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPE = "float32"  # CPU kernels are fastest and exact in float32
DEVICES = ("cpu", "cuda")
DEFAULT_DEVICE = "cpu"


class DeviceUnavailableError(RuntimeError):
    """A stage asked for a device this process cannot see."""


def check_device(device: str, where: str = "") -> torch.device:
    """The torch device for ``device`` ('cpu', 'cuda' or 'cuda:N'); a clear error when it is not there."""
    kind = device.split(":")[0]
    if kind not in DEVICES:
        raise InvalidRequestError(f"device must be one of {list(DEVICES)} (or cuda:N), got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        place = f" on {where}" if where else ""
        raise DeviceUnavailableError(
            f"device {device!r} was asked for{place}, but torch sees no CUDA GPU there "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use device: cpu or a GPU node"
        )
    return torch.device(device)


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with what the engine needs to know about it."""

    model: PreTrainedModel
    tokenizer: Any | None  # None for token-id-only models (the tiny test pair)
    model_id: str
    dtype: str
    fingerprint: str  # model id + config hash + dtype: KV is only valid for the same fingerprint
    device: str = DEFAULT_DEVICE  # where the weights (and the sessions' KV) live

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def model_fingerprint(model_id: str, config, dtype: str) -> str:
    """Identify a model for KV compatibility: id, a hash of its config, its dtype."""
    config_json = json.dumps(config.to_diff_dict(), sort_keys=True, default=str)
    config_hash = hashlib.sha256(config_json.encode()).hexdigest()[:16]
    return f"{model_id}:{config_hash}:{dtype}"


def set_num_threads(num_threads: int | None) -> None:
    """Set torch's intra-op thread count (process-wide) when given."""
    if num_threads is not None:
        if num_threads < 1:
            raise InvalidRequestError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str = DEFAULT_DTYPE,
    num_threads: int | None = None,
    model_id: str | None = None,
    device: str = DEFAULT_DEVICE,
) -> LoadedModel:
    """Load any Hugging Face causal-LM folder (AutoModelForCausalLM / AutoTokenizer) onto ``device``."""
    path = Path(path)
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model folder (no config.json); "
            "run `splitspec models prepare` for the default pair"
        )
    torch_device = check_device(device)
    set_num_threads(num_threads)
    from transformers import AutoModelForCausalLM  # (its import is seconds: only processes that load a model pay it)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(torch_device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    model_id = model_id or path.name
    logger.info("loaded %s (%s, %d layers) from %s on %s", model_id, dtype, model.config.num_hidden_layers, path, device)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        dtype=dtype,
        fingerprint=model_fingerprint(model_id, model.config, dtype),
        device=device,
    )


def wrap_model(model: PreTrainedModel, *, model_id: str, tokenizer=None, dtype: str = DEFAULT_DTYPE,
               device: str = DEFAULT_DEVICE) -> LoadedModel:
    """Wrap an in-memory model (tests, freshly built pairs) like ``load_causal_lm`` does, moved to ``device``."""
    model = model.to(check_device(device)).eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, model_id, dtype, model_fingerprint(model_id, model.config, dtype), device)


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model whose token ids mean something else than the target's."""
    _check_same_vocabulary(
        f"draft model {draft.model_id!r} and target model {target.model_id!r}",
        (target.vocab_size, draft.vocab_size),
        (target.tokenizer, draft.tokenizer),
    )


def _check_same_vocabulary(names: str, vocab_sizes: tuple[int, int], tokenizers: tuple) -> None:
    (target_size, draft_size), (target_tok, draft_tok) = vocab_sizes, tokenizers
    if draft_size != target_size:
        raise ModelMismatchError(
            f"{names} have different vocabulary sizes ({draft_size} vs {target_size}); "
            "speculative decoding needs a drafter that shares the target's tokenizer"
        )
    if (target_tok is None) != (draft_tok is None):
        raise ModelMismatchError(f"{names}: only one of them has a tokenizer")
    if target_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise ModelMismatchError(
            f"{names} have different tokenizers (same size, different token ids); "
            "use a drafter trained with the target's tokenizer"
        )


def config_of(path: str | Path):
    """Read a model folder's config without loading weights."""
    return AutoConfig.from_pretrained(path)


@dataclass
class ModelInfo:
    """What the serving edge needs of the target without loading its weights."""

    tokenizer: Any
    vocab_size: int
    max_context: int
    eos_token_ids: set[int]


def describe(path: str | Path) -> ModelInfo:
    """Tokenizer, vocabulary size, context length and EOS ids of a model folder."""
    from transformers import GenerationConfig

    config = config_of(path)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    eos_ids = set() if eos is None else set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    return ModelInfo(
        tokenizer=AutoTokenizer.from_pretrained(path),
        vocab_size=int(config.vocab_size),
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
    )


def check_tokenizers(target: ModelInfo, draft_path: str | Path) -> None:
    """``check_pair`` without loading weights: same vocabulary size and the same token ids."""
    draft = describe(draft_path)
    _check_same_vocabulary(
        f"draft model {str(draft_path)!r} and the target model",
        (target.vocab_size, draft.vocab_size),
        (target.tokenizer, draft.tokenizer),
    )


@dataclass
class HeadParts:
    """What an EAGLE head reads of its target (``eagle.EagleHead``), without the target: its config, its embeddings
    and its last decoder layer (``model``: the target's architecture with that one layer; the rest unloaded)."""

    config: Any  # the target's own config (its identity: eagle_draft.target_identity)
    model: PreTrainedModel


def load_head_parts(path: str | Path) -> HeadParts:
    """The embeddings and the last decoder layer of the target in ``path`` (safetensors), in float32, read alone:
    a drafter stage of its own needs them for an EAGLE head, not the target's other layers."""
    import copy

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    last = config.num_hidden_layers - 1
    one_layer = copy.deepcopy(config)
    one_layer.num_hidden_layers = 1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one_layer)
    wanted = {"model.embed_tokens.weight": "model.embed_tokens.weight"}
    prefix = f"model.layers.{last}."
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if key in wanted or key.startswith(prefix):
                    state[key.replace(prefix, "model.layers.0.")] = f.get_tensor(key).float()
    if "model.embed_tokens.weight" not in state or not any(k.startswith("model.layers.0.") for k in state):
        raise FileNotFoundError(f"{path} holds no safetensors with the target's embeddings and layer {last}")
    model.load_state_dict(state, strict=False, assign=True)  # (the other tensors stay on the meta device, unread)
    return HeadParts(config, model.eval().requires_grad_(False))
