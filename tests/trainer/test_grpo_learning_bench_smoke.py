"""benchmarks/grpo_learning_bench.py runs end to end in a few steps (the 5-minute check is run by hand)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_learning_bench.py"


@pytest.mark.slow
def test_learning_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("grpo_learning_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["grpo_learning_bench"] = bench
    spec.loader.exec_module(bench)
    small_run = "--sft-steps 2 --sft-tasks 4 --max-steps 2 --tasks 2 --group 2 --eval-tasks 3 --eval-samples 1"
    args = bench.parse_args([*small_run.split(), "--horizons", "2,3", "--stage-steps", "1"])
    code = asyncio.run(bench.main(args))
    out = capsys.readouterr().out
    assert code in (0, 1)  # a 2-step run is not expected to reach the target
    assert "step 0: horizon 2" in out and "step 1: horizon 3" in out  # the ScalingInter stages
    assert "eval after the SFT warm-up (before GRPO): success" in out and "eval after 2 GRPO steps" in out
    assert "(3 episodes of 3 tasks" in out
    assert "gain:" in out and ("-> PASS" in out or "-> FAIL" in out)
