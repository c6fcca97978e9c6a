"""Loading the engine's model and new weights for it, and what the engine reads off a model."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from agentgym.cpus import cpu_has_bf16_units
from agentgym.inference.errors import WeightLoadError


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    """The parameters' dtype: float32 on CPU (whatever is asked: bfloat16 there means bf16 matmuls over float32
    parameters where the CPU has bf16 units, `cpu_matmul_dtype`), else as asked (bf16)."""
    if device.type == "cpu":
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16}.get(dtype or "bfloat16", torch.bfloat16)


def cpu_matmul_dtype(device: torch.device, dtype: str | None) -> torch.dtype | None:
    """bf16 for the matmuls of a CPU engine asked for ``bfloat16`` on a CPU with bf16 units (AVX512-BF16 or
    AMX; parameters, norms and logits stay float32, `decoder.LeanDecoder`); None: float32 throughout (other
    dtypes, GPUs, or a CPU that would emulate bf16 several times slower, `agentgym.cpus.cpu_has_bf16_units`)."""
    if device.type != "cpu" or dtype != "bfloat16" or not cpu_has_bf16_units():
        return None
    return torch.bfloat16


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_model(source: str | Path, device: torch.device, dtype: torch.dtype) -> Any:
    """An HF causal LM from a folder, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model: Any = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    return model.to(device).eval()


def cache_argument(model: Any) -> str:
    """The forward keyword of the KV cache: `cache` in recent transformers, `past_key_values` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def growable_cache(model: Any) -> bool:
    """Whether the model's KV cache is plain full-attention `DynamicLayer`s: the running batch then uses
    `GrowingLayer`s, merges newly admitted requests, and the prefix cache can serve it."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def kv_bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in the KV cache (all layers)."""
    config = model.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    element = torch.empty((), dtype=dtype).element_size()
    return max(1, 2 * int(config.num_hidden_layers) * kv_heads * head_dim * element)


def load_candidate(
    uri: str, config: Any, vocab_size: int, pad_token_id: int, device: torch.device, dtype: torch.dtype
) -> Any:
    """A new model object holding the weights at `uri` (checked before it can be swapped in); `config` is the
    served model's."""
    path = Path(uri.removeprefix("file://")).expanduser()
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise WeightLoadError(f"{uri}: folder has no config.json")
            model = load_model(path, device, dtype)
        elif path.is_file():
            model = model_from_state_dict(path, config, device, dtype)
        else:
            raise WeightLoadError(f"{uri}: no such file or folder")
    except WeightLoadError:
        raise
    except Exception as error:
        raise WeightLoadError(f"{uri}: could not load weights: {type(error).__name__}: {error}") from error
    vocab = int(model.config.vocab_size)
    if vocab != vocab_size:
        raise WeightLoadError(f"{uri}: vocabulary size {vocab} differs from the served model's {vocab_size}")
    with torch.inference_mode():
        probe = torch.tensor([[pad_token_id]], device=device)
        logits = model(input_ids=probe).logits
    if not torch.isfinite(logits).all():
        raise WeightLoadError(f"{uri}: the new weights produce non-finite logits")
    return model


def model_from_state_dict(path: Path, config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A model of the served architecture (`config`) with the weights of a state-dict file."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    elif path.suffix in (".pt", ".pth", ".bin"):
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        state = loaded.get("model", loaded) if isinstance(loaded, dict) else loaded
        if not isinstance(state, dict):
            raise WeightLoadError(f"{path}: not a state dict")
    else:
        raise WeightLoadError(f"{path}: expected a model folder, .safetensors, .pt, .pth or .bin file")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    result = model.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise WeightLoadError(
            f"{path}: state dict does not match the served architecture "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]})"
        )
    if tied:
        model.tie_weights()
    return model.to(device).eval()
