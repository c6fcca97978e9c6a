"""DeepSpeed backend: config generation and the launcher command (the engine trains in test_deepspeed_engine)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.deepspeed_backend import deepspeed_available, deepspeed_config, launcher_command


def _config(**kw: Any) -> RLTrainerConfig:
    values: dict[str, Any] = {"backend": "deepspeed", "gpus": 4, "bf16": True, "learning_rate": 2e-6}
    values.update(kw)
    return RLTrainerConfig(**values)


def test_zero2_bf16() -> None:
    ds = deepspeed_config(_config(zero_stage=2, max_grad_norm=0.5))
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["reduce_scatter"] is True
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == 2e-6
    # one packed row per micro-batch; the trainer marks accumulation boundaries itself
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_accumulation_steps"] == 1
    assert ds["train_batch_size"] == 4  # one rank per GPU
    assert deepspeed_config(_config(zero_stage=2), world_size=2)["train_batch_size"] == 2  # the ranks started
    assert ds["activation_checkpointing"] == {}


def test_zero3_gathers_weights_and_checkpointing() -> None:
    ds = deepspeed_config(_config(zero_stage=3, gradient_checkpointing=True, bf16=False, dtype="float16"))
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert "reduce_scatter" not in zero
    assert ds["fp16"] == {"enabled": True} and ds["bf16"] == {"enabled": False}
    assert ds["activation_checkpointing"]["partition_activations"] is False


def test_torch_adam_on_request_only() -> None:
    # On GPUs DeepSpeed's FusedAdam steps; on its CPU accelerator the engine asks for torch's AdamW.
    assert "torch_adam" not in deepspeed_config(_config(zero_stage=2))["optimizer"]["params"]
    assert deepspeed_config(_config(zero_stage=2), torch_adam=True)["optimizer"]["params"]["torch_adam"] is True


def test_launcher_command() -> None:
    argv = launcher_command("trainer.json", 8)
    assert argv == [
        "deepspeed",
        "--num_gpus",
        "8",
        "--master_port",
        "29500",
        "--module",
        "agentgym.trainer.entrypoint",
        "--config",
        "trainer.json",
    ]
    multi = launcher_command("unused", 8, run_yaml="run.yaml", hostfile="/etc/hosts.ds", master_port=29600)
    assert multi[:3] == ["deepspeed", "--hostfile", "/etc/hosts.ds"] and multi[-2:] == ["--run", "run.yaml"]
    with pytest.raises(ValueError):
        launcher_command("trainer.json", 0)


def test_deepspeed_needs_gpus_and_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="gpus"):
        RLTrainerConfig(backend="deepspeed", gpus=0)
    with pytest.raises(ValueError, match="backend torch trains on one device"):
        RLTrainerConfig(backend="torch", gpus=2)  # one process: the second GPU would sit idle
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as where the package is not installed
    assert not deepspeed_available()
    import torch

    from agentgym.trainer.backend import OptimizerSettings
    from agentgym.trainer.deepspeed_backend import DeepSpeedEngine

    with pytest.raises(RuntimeError, match="deepspeed package"):
        DeepSpeedEngine(torch.nn.Linear(2, 2), OptimizerSettings(1e-3), _config())
