"""`agentgym run` with `inference.engine: vllm` refuses before it starts anything, saying why: no vLLM
environment, or (on CPU) a model whose head size vLLM's CPU attention cannot serve. No vLLM process runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentgym.local.runner import VLLM_PYTHON_ENV, LocalRunner, local_command
from agentgym.local.supervisor import ProcessFailedError
from agentgym.spec import TrainingRun


def vllm_run(model: str) -> TrainingRun:
    return TrainingRun.model_validate(
        {
            "apiVersion": "agentgym.io/v1alpha1",
            "kind": "TrainingRun",
            "metadata": {"name": "preflight"},
            "spec": {
                "model": {"name": model, "dtype": "float32"},
                "environments": [{"name": "babyai"}],
                "inference": {"engine": "vllm", "gpusPerReplica": 0},
            },
        }
    )


async def test_no_vllm_environment_names_the_setup_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "missing" / "python"))
    runner = LocalRunner(vllm_run("builtin:tiny"), tmp_path / "run")
    with pytest.raises(ProcessFailedError, match=r"no vLLM environment at .*missing/python: run scripts/setup-vllm"):
        await runner._start_platform()
    assert runner.nats is None  # nothing was started


async def test_an_unsupported_head_size_is_refused_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / "python"
    python.touch()
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(python))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    runner = LocalRunner(vllm_run(str(model)), tmp_path / "run")
    with pytest.raises(ProcessFailedError, match=r"head size 16 .* vLLM's CPU attention serves head sizes 32, 64"):
        await runner._start_platform()
    assert runner.nats is None


def test_the_vllm_component_runs_on_vllms_python_with_the_builtin_models_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/opt/vllm/bin/python")
    argv = local_command(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "builtin:tiny", "--x"])
    assert argv[0] == "/opt/vllm/bin/python" and argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert (Path(argv[4]) / "config.json").is_file() and argv[5] == "--x"
    assert local_command(["python", "-m", "agentgym.trainer.entrypoint"])[0] != "/opt/vllm/bin/python"
