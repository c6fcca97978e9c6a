"""The DeepSpeed backend trained for real, on DeepSpeed's CPU accelerator (gloo, one rank).

No GPU here, but DeepSpeed runs ZeRO-2 and ZeRO-3 on CPU, so its engine, the trainer's use of it and
its checkpoints are tested, not only its config: each stage must train the same two GRPO steps as
the plain torch backend (fp32, same AdamW: equal up to summation order), resume exactly from its own
checkpoint, and save a plain HF folder. Several ranks: test_data_parallel. Untested here: CUDA and bf16.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage_trains_like_torch_and_resumes_exactly(stage: int, tiny_model: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(HERE / "deepspeed_cpu_run.py"), str(stage), str(tmp_path), str(tiny_model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["engine"], result["optimizer"]) == ("DeepSpeedEngine", "AdamW")
    assert result["start_diff"] == 0.0  # DeepSpeed took the policy's weights as they were
    assert result["moved"] > 1e-3  # the two steps did change them ...
    assert result["deepspeed_vs_torch"] < 1e-5  # ... as the torch backend does
    assert all(norm > 0 for norm in result["grad_norms"])
    assert result["resumed_vs_straight"] == 0.0  # 1 step + checkpoint + resume + 1 step == 2 steps
    assert result["resumed_from"] == result["saved"]
    # A plain HF folder (gathered from ZeRO-3's partitions) next to DeepSpeed's own optimizer state.
    assert {"config.json", "model.safetensors", "tokenizer.json", "engine", "trainer_state.json"} <= set(
        result["checkpoint_files"]
    )
    assert result["exported_parameters"] == result["expected_parameters"]
