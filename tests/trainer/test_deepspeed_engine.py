"""The DeepSpeed backend trained for real, on DeepSpeed's CPU accelerator (gloo, one rank).

No GPU here, but DeepSpeed runs ZeRO-2 and ZeRO-3 on CPU, so its engine, the trainer's use of it and
its checkpoints are tested, not only its config: each stage must train the same two GRPO steps as
the plain torch backend (fp32, same AdamW: equal up to rounding, `trainer_helpers.update_gap`), resume
exactly from its own checkpoint, and save a plain HF folder. DeepSpeed's bf16 (bf16 weights, fp32 master weights) with
activation checkpointing trains too, close to the fp32 gradients, and resumes exactly. Several ranks:
test_data_parallel. Untested here: CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_helpers import UPDATE_GAP_BOUND

from agentgym.messaging import free_port

HERE = Path(__file__).resolve().parent


def _run(stage: int, tmp_path: Path, tiny_model: Path, precision: str = "fp32") -> dict[str, Any]:
    env = {
        **os.environ,
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(HERE / "deepspeed_cpu_run.py"), str(stage), str(tmp_path), str(tiny_model), precision],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage_trains_like_torch_and_resumes_exactly(stage: int, tiny_model: Path, tmp_path: Path) -> None:
    result = _run(stage, tmp_path, tiny_model)
    assert (result["engine"], result["optimizer"]) == ("DeepSpeedEngine", "AdamW")
    assert result["start_diff"] == 0.0  # DeepSpeed took the policy's weights as they were
    assert result["moved"] > 1e-3  # the two steps did change them ...
    # ... as the torch backend does, up to float32 rounding amplified by AdamW (trainer_helpers.update_gap)
    assert result["deepspeed_vs_torch"] < UPDATE_GAP_BOUND
    assert all(norm > 0 for norm in result["grad_norms"])
    assert result["resumed_vs_straight"] == 0.0  # 1 step + checkpoint + resume + 1 step == 2 steps
    assert result["resumed_from"] == result["saved"]
    # A plain HF folder (gathered from ZeRO-3's partitions) next to DeepSpeed's own optimizer state.
    assert {"config.json", "model.safetensors", "tokenizer.json", "engine", "trainer_state.json"} <= set(
        result["checkpoint_files"]
    )
    assert result["exported_parameters"] == result["expected_parameters"]


@pytest.mark.slow
def test_bf16_with_gradient_checkpointing_trains_and_resumes_exactly(tiny_model: Path, tmp_path: Path) -> None:
    """DeepSpeed's bf16 (bf16 weights, fp32 master weights in the optimizer) with activation checkpointing, ZeRO-3."""
    result = _run(3, tmp_path, tiny_model, "bf16")
    assert result["dtype"] == "torch.bfloat16" and result["exported_dtype"] == "torch.bfloat16"
    assert result["moved"] > 1e-3
    # The gradients are bf16 computations of the fp32 ones: close, not equal.
    for norm, plain_norm in zip(result["grad_norms"], result["plain_grad_norms"], strict=True):
        assert norm == pytest.approx(plain_norm, rel=0.05)
    # The fp32 master weights are in the checkpoint: the resumed run makes exactly the straight run's update.
    assert result["resumed_vs_straight"] == 0.0
    assert result["exported_parameters"] == result["expected_parameters"]
