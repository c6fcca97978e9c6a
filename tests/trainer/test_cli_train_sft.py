"""`agentgym sft` and `agentgym train` (the commands; the loop itself is tested over NATS elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from agentgym.cli.main import app


def _spec(tmp_path: Path, model: Path, **trainer: object) -> Path:
    document = {
        "apiVersion": "agentgym.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "cli-sft"},
        "spec": {
            "model": {"name": str(model), "dtype": "float32", "maxContextTokens": 1024},
            "environments": [{"name": "textcraft"}],
            "algorithm": {"name": "grpo", "groupSize": 2, "klCoef": 0.0},
            "inference": {"engine": "hf", "gpusPerReplica": 0},
            "trainer": {"sftWarmupSteps": 2, **trainer},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_sft_command_writes_a_warm_started_checkpoint(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, tiny_model)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sft", str(spec), "--tasks", "2", "--batch-size", "2", "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    state = json.loads((out / "checkpoints" / "step-0" / "trainer_state.json").read_text())
    assert state["sft_done"] is True and state["policy_version"] == 1 and state["step"] == 0
    again = CliRunner().invoke(app, ["sft", str(spec), "--output-dir", str(out)])
    assert again.exit_code != 0 and "already holds" in again.output


def test_sft_command_takes_the_warm_up_settings_of_the_spec(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, tiny_model, sftTasks=3, sftBatchSize=3, sftLearningRate=1e-3, sftThoughts=False)
    result = CliRunner().invoke(app, ["sft", str(spec), "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "SFT on 3 expert demonstrations, 2 steps" in result.output  # trainer.sftTasks, not a CLI default
    config = json.loads((tmp_path / "out" / "checkpoints" / "step-0" / "trainer_state.json").read_text())["config"]
    assert (config["sft_tasks"], config["sft_batch_size"], config["sft_learning_rate"]) == (3, 3, 1e-3)
    assert config["sft_thoughts"] is False
    # A learning rate of 0 would train nothing: refused before any model loads, naming the option.
    refused = CliRunner().invoke(app, ["sft", str(spec), "--learning-rate", "0", "--output-dir", str(tmp_path / "x")])
    assert refused.exit_code == 2 and "--learning-rate" in refused.output
    assert not (tmp_path / "x").exists()


def test_train_command_needs_nats(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTGYM_NATS_URL", raising=False)
    spec = _spec(tmp_path, tiny_model)
    result = CliRunner().invoke(app, ["train", str(spec), "--output-dir", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "no NATS URL" in str(result.exception) + result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: agentgym.io/v1alpha1\nkind: TrainingRun\nmetadata: {name: x}\nspec: {}\n")
    assert CliRunner().invoke(app, ["train", str(bad)]).exit_code == 2


def test_train_command_starts_one_rank_per_gpu_under_the_launcher(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agentgym.trainer.launch as launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    started: list[list[str]] = []
    monkeypatch.setattr(launch, "main", lambda argv: started.append(argv) or 0)
    spec = _spec(tmp_path, tiny_model, backend="deepspeed", gpus=2)
    result = CliRunner().invoke(app, ["train", str(spec), "--nats-url", "nats://127.0.0.1:4222"])
    assert result.exit_code == 0, result.output
    [argv] = started
    assert Path(argv[0]).name == "deepspeed" and argv[1:3] == ["--num_gpus", "2"]
    assert argv[argv.index("--module") + 1] == "agentgym.trainer.entrypoint"
    assert argv[-4:] == ["--log-level", "info", "--nats-url", "nats://127.0.0.1:4222"]
