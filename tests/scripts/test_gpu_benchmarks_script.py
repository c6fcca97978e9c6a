"""scripts/gpu-benchmarks.sh, the GPU checks as one script for a lent machine, runs its steps on CPU (`--smoke`):
the carried tokenizer, the source-tree PYTHONPATH, both benchmarks, and logs under $OUT."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym.inference.models import smollm2_tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-benchmarks.sh"


def run_script(carry: Path, out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    temporary = out.parent / "tmp"
    temporary.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHON": sys.executable, "AGENTGYM_GPU_CARRY": str(carry), "OUT": str(out)}
    env["TMPDIR"] = str(temporary)
    return subprocess.run(["bash", str(SCRIPT), *options], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_smoke_runs_both_benchmarks_from_the_carried_tokenizer_and_writes_their_logs(tmp_path: Path) -> None:
    carry = tmp_path / "carry"
    shutil.copytree(smollm2_tokenizer_dir(), carry / "tokenizer")
    result = run_script(carry, tmp_path / "out", "--smoke")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    trainer = (tmp_path / "out" / "trainer_gpu_bench.txt").read_text()
    inference = (tmp_path / "out" / "inference_gpu_bench.txt").read_text()
    assert "smoke test only" in trainer
    assert "## platform engine (float32 on cpu), shape smoke, 64 conversations x 5 turns x 36 tokens" in inference
    assert not list((tmp_path / "tmp").glob("agentgym-site.*"))  # its folder of carried wheels is removed


def test_without_the_carried_tokenizer_it_says_how_to_prepare(tmp_path: Path) -> None:
    result = run_script(tmp_path / "empty", tmp_path / "out")
    assert result.returncode == 1 and "--prepare" in result.stderr and not (tmp_path / "out").exists()
