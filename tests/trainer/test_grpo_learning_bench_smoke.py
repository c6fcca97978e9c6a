"""benchmarks/grpo_learning_bench.py runs end to end in a few steps (the 5-minute check is run by hand)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_learning_bench.py"


@pytest.mark.slow
def test_learning_bench_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("grpo_learning_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["grpo_learning_bench"] = bench
    spec.loader.exec_module(bench)
    small_run = "--sft-steps 2 --sft-tasks 4 --max-steps 2 --tasks 2 --group 2 --eval-tasks 3 --eval-samples 1"
    warm = tmp_path / "warm"
    argv = [*small_run.split(), "--horizons", "2,3", "--stage-steps", "1", "--warm-start", str(warm)]
    code = asyncio.run(bench.main(bench.parse_args(argv)))
    out = capsys.readouterr().out
    assert code in (0, 1)  # a 2-step run is not expected to reach the target
    assert "step 0: horizon 2" in out and "step 1: horizon 3" in out  # the ScalingInter stages
    assert "eval after the SFT warm-up (before GRPO): success" in out and "eval after 2 GRPO steps" in out
    assert "(3 episodes of 3 tasks" in out
    assert "gain:" in out and ("-> PASS" in out or "-> FAIL" in out)
    assert f"saved to {warm}" in out and (warm / "config.json").is_file()
    # A second run starts from the saved warm start, without the warm-up, and measures the same baseline.
    baseline = out.split("eval after the SFT warm-up (before GRPO): success ")[1].split(" ")[0]
    code = asyncio.run(bench.main(bench.parse_args([*argv[:-2], "--max-steps", "1", "--warm-start", str(warm)])))
    again = capsys.readouterr().out
    assert code in (0, 1)
    assert "no warm-up run" in again and "SFT warm-up:" not in again
    assert f"eval after the SFT warm-up (before GRPO): success {baseline} " in again


def test_learning_bench_rejects_a_warm_start_folder_without_a_policy(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("grpo_learning_bench_args", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--warm-start", str(tmp_path)])
    assert exited.value.code == 2
    assert bench.parse_args(["--warm-start", str(tmp_path / "new")]).warm_start == str(tmp_path / "new")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--step-group-coef", "-1"], "--step-group-coef must be >= 0"),
        (["--step-group-gamma", "1.5"], "--step-group-gamma must be in [0, 1]"),
    ],
)
def test_learning_bench_rejects_bad_step_group_settings(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("grpo_learning_bench_flags", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
