"""benchmarks/grpo_learning_bench.py runs end to end in a few steps (the 5-minute check is run by hand)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from agentgym.proto import rl_pb2

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_learning_bench.py"


@pytest.mark.slow
def test_learning_bench_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("grpo_learning_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["grpo_learning_bench"] = bench
    spec.loader.exec_module(bench)
    small_run = (
        "--sft-steps 2 --sft-tasks 4 --max-steps 2 --tasks 2 --group 2 --eval-tasks 3 --validation-tasks 4"
        " --eval-samples 1"
    )
    warm = tmp_path / "warm"
    argv = [*small_run.split(), "--horizons", "2,3", "--stage-steps", "1", "--warm-start", str(warm)]
    code = asyncio.run(bench.main(bench.parse_args(argv)))
    out = capsys.readouterr().out
    assert code in (0, 1)  # a 2-step run is not expected to reach the target
    assert "step 0: horizon 2" in out and "step 1: horizon 3" in out  # the ScalingInter stages
    before = "eval after the SFT warm-up (before GRPO), validation: success "
    assert before in out and "eval after 2 GRPO steps, test-easy: success" in out
    assert "(4 episodes of 4 tasks on 4 layouts" in out and "(3 episodes of 3 tasks on 1 layouts" in out
    assert "validation: " in out and "points (paired by layout)" in out and ("-> PASS" in out or "-> FAIL" in out)
    assert f"saved to {warm}" in out and (warm / "config.json").is_file()
    assert len(json.loads((warm / "sft_task_ids.json").read_text())) == 4  # kept out of the validation layouts
    # Reused with other warm-up flags, which it would ignore: refused, naming them.
    with pytest.raises(SystemExit) as exited:
        bench.parse_args([*argv, "--sft-steps", "3", "--sft-thoughts"])
    assert exited.value.code == 2
    refused = capsys.readouterr().err
    assert "--sft-steps 2 (not 3)" in refused and "--sft-thoughts False (not True)" in refused
    # A second run starts from the saved warm start, without the warm-up, and measures the same baseline.
    baseline = out.split(before)[1].split(" ")[0]
    trained = tmp_path / "trained"
    rerun = [*argv[:-2], "--max-steps", "1", "--warm-start", str(warm), "--save-policy", str(trained)]
    code = asyncio.run(bench.main(bench.parse_args(rerun)))
    again = capsys.readouterr().out
    assert code in (0, 1)
    assert "no warm-up run" in again and "SFT warm-up:" not in again
    assert f"{before}{baseline} " in again
    assert f"policy after GRPO saved to {trained}" in again and (trained / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as exited:  # never written over
        bench.parse_args(rerun)
    assert exited.value.code == 2


def load_bench(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_learning_bench_rejects_a_warm_start_folder_without_a_policy(tmp_path: Path) -> None:
    bench = load_bench("grpo_learning_bench_args")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--warm-start", str(tmp_path)])
    assert exited.value.code == 2
    assert bench.parse_args(["--warm-start", str(tmp_path / "new")]).warm_start == str(tmp_path / "new")
    (tmp_path / "config.json").write_text("{}")  # a policy, but not the tasks it was fine-tuned on
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--warm-start", str(tmp_path)])
    assert exited.value.code == 2


def test_validation_layouts_are_held_out() -> None:
    from agentgym import envs

    bench = load_bench("grpo_learning_bench_split")
    catalog = envs.environment_class("babyai").catalog()
    demonstrated = ["GoToRedBall/s1000999", "GoToRedBallGrey/s1000997"]
    validation, train = bench.split_train_and_validation(catalog, 6, demonstrated)
    # From the end of train-easy, one task per layout, the levels in turn, demonstrated layouts skipped.
    assert validation == [
        "GoToRedBall/s1000998",
        "GoToRedBallGrey/s1000996",
        "GoToRedBallNoDists/s1000995",
        "GoToRedBall/s1000994",
        "GoToRedBallGrey/s1000993",
        "GoToRedBallNoDists/s1000992",
    ]
    held_out = {bench.layout_of(t) for t in validation}
    assert not held_out & {bench.layout_of(t) for t in train}
    assert len(train) == 3000 - 3 * 6 and "GoToRedBallNoDists/s1000999" in train
    # More validation layouts than the warm-up left undemonstrated: refused, saying how many there are.
    most_demonstrated = [f"GoToRedBall/s{1000000 + k}" for k in range(990)]
    with pytest.raises(ValueError, match="11 validation layouts asked; only 10 are not in the warm-up's demos"):
        bench.split_train_and_validation(catalog, 11, most_demonstrated)


def test_learning_bench_refuses_bad_validation_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("grpo_learning_bench_validation")
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--validation-tasks", "0"])
    assert exited.value.code == 2 and "--validation-tasks must be >= 1, not 0" in capsys.readouterr().err
    for argv, message in (
        (["--sft-steps", "0"], "--sft-steps must be >= 1, not 0"),
        (["--sft-tasks", "-1"], "--sft-tasks must be >= 1, not -1"),
        (["--sft-batch", "0"], "--sft-batch must be >= 1, not 0"),
        (["--sft-lr", "0"], "--sft-lr must be > 0, not 0.0"),
        (["--algorithm", "dpo", "--dpo-beta", "0"], "--dpo-beta must be > 0, not 0.0"),
    ):
        with pytest.raises(SystemExit) as exited:
            bench.parse_args(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err
    # Too many: refused before any model is loaded or folder written.
    args = bench.parse_args(["--validation-tasks", "2000", "--sft-tasks", "4"])
    assert asyncio.run(bench.main(args)) == 2
    assert "error: --validation-tasks: 2000 validation layouts asked; only" in capsys.readouterr().err


def test_gain_is_paired_by_layout() -> None:
    bench = load_bench("grpo_learning_bench_gain")

    def episodes(outcomes: dict[str, list[bool]]) -> list[rl_pb2.Trajectory]:
        return [rl_pb2.Trajectory(task_id=t, success=s) for t, results in outcomes.items() for s in results]

    # Layout s1 is played on two levels: its three episodes are one unit.
    before = episodes({"GoToRedBall/s1": [True, False], "GoToRedBallGrey/s1": [False], "GoToRedBall/s2": [False]})
    after = episodes({"GoToRedBall/s1": [True, True], "GoToRedBallGrey/s1": [True], "GoToRedBall/s2": [False]})
    assert bench.success_by_layout(before) == {"s1": pytest.approx(1 / 3), "s2": 0.0}
    rate, error = bench.success_with_error(before)
    assert rate == pytest.approx(1 / 6) and error == pytest.approx(1 / 6)  # sd of (1/3, 0) is sqrt(2)/6, / sqrt(2)
    gain, gain_error = bench.paired_gain(before, after)
    assert gain == pytest.approx(1 / 3) and gain_error == pytest.approx(1 / 3)  # differences 2/3 and 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--step-group-coef", "-1"], "--step-group-coef must be >= 0"),
        (["--step-group-gamma", "1.5"], "--step-group-gamma must be in [0, 1]"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--turn-validity-coef", "-1"], "--turn-validity-coef must be >= 0, not -1.0"),
    ],
)
def test_learning_bench_rejects_bad_step_group_settings(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench("grpo_learning_bench_flags")
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_learning_bench_gates_validity_credit_on_success_by_default() -> None:
    bench = load_bench("grpo_learning_bench_gate")
    assert bench.parse_args([]).turn_validity_needs_success is True
    assert bench.parse_args(["--no-turn-validity-needs-success"]).turn_validity_needs_success is False
