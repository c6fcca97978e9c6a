"""benchmarks/learning_bench.py's report: per-environment gains of a run with several environments, and the verdict.

The runs themselves take minutes a seed (the recipes are smoke-tested in tests/examples); here the report is
checked against hand-computed values.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from agentgym.local.run_eval import PhaseResult

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_bench() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its sibling quickstart_bench
    try:
        spec = importlib.util.spec_from_file_location("learning_bench", BENCHMARKS / "learning_bench.py")
        assert spec is not None and spec.loader is not None
        bench = importlib.util.module_from_spec(spec)
        sys.modules["learning_bench"] = bench  # its dataclasses look their module up
        spec.loader.exec_module(bench)
        return bench
    finally:
        sys.path.remove(str(BENCHMARKS))


def _phase(name: str, babyai: dict[str, float], textcraft: dict[str, float]) -> PhaseResult:
    def env(split: str, tasks: dict[str, float]) -> dict[str, object]:
        return {"split": split, "success": sum(tasks.values()) / len(tasks), "success_se": 0.1, "task_success": tasks}

    envs = {"babyai": env("test-easy", babyai), "textcraft": env("test-shallow", textcraft)}
    return PhaseResult(name, 0, 5, 0.0, 0.0, 7, 7, 1.0, envs)


def test_each_environment_of_a_mixed_run_gets_its_own_paired_gain() -> None:
    bench = load_bench()
    start = _phase("start", {"a": 0.0, "b": 0.0, "c": 1.0}, {"x": 0.0, "y": 0.0, "z": 0.0, "w": 0.0})
    sft = _phase("sft", {"a": 1.0, "b": 0.0, "c": 1.0}, {"x": 0.0, "y": 0.0, "z": 0.0, "w": 1.0})
    end = _phase("end", {"a": 1.0, "b": 1.0, "c": 1.0}, {"x": 1.0, "y": 0.0, "z": 0.0, "w": 1.0})
    result = bench.SeedResult(1, 600.0, {"start": start, "sft": sft, "end": end}, (0.0, 0.0, 7))
    babyai, textcraft = bench.environment_lines(result)
    # babyai: differences 1, 1, 0 -> +66.7 pts, s.e. sqrt(1/3 / 2) / sqrt(3) * 100 = 33.3
    assert (
        "babyai" in babyai and "0.333 -> sft 0.667 -> 1.000" in babyai and "gain +66.7 ± 33.3 pts (3 tasks)" in babyai
    )
    # textcraft: differences 1, 0, 0, 1 -> +50 pts, s.e. sqrt(1/3) / 2 * 100 = 28.9
    assert "0.000 -> sft 0.250 -> 0.500" in textcraft and "gain +50.0 ± 28.9 pts (4 tasks)" in textcraft
    one = bench.SeedResult(1, 600.0, {"start": _single(start), "end": _single(end)}, (0.0, 0.0, 3))
    assert bench.environment_lines(one) == []  # one environment: the seed line says it all


def _single(phase: PhaseResult) -> PhaseResult:
    return PhaseResult(phase.phase, 0, 5, 0.0, 0.0, 3, 3, 1.0, {"babyai": phase.environments["babyai"]})


def test_the_verdict_counts_seeds_that_gain_enough_in_time() -> None:
    bench = load_bench()
    seeds = [
        bench.SeedResult(1, 14 * 60.0, {}, (25.0, 5.0, 48)),
        bench.SeedResult(2, 16 * 60.0, {}, (30.0, 5.0, 48)),  # too slow
        bench.SeedResult(3, 10 * 60.0, {}, (19.9, 5.0, 48)),  # too little
        bench.SeedResult(4, 12 * 60.0, {}, (20.0, 5.0, 48)),
    ]
    assert bench.verdict("textcraft", seeds).endswith("2 passed (seeds [1, 4]): FAIL")
    assert bench.verdict("textcraft", seeds[:1] + seeds[3:] + seeds[:1]).endswith(": PASS")
    assert bench.verdict("babyai+textcraft", seeds).startswith("no target")


def test_eval_episodes_ended_by_errors_are_flagged_on_the_seed_line() -> None:
    """A SciWorld run whose service failed 36 of 48 start episodes printed a plain 0.000: errors count as
    failures, so the line must say the success measures the service."""
    bench = load_bench()
    start = _single(_phase("start", {"a": 0.0, "b": 0.0, "c": 0.0}, {"x": 0.0}))
    start.environments["babyai"].update(errors=2, error_reasons={"EnvServiceError: 503 busy": 2})
    end = _single(_phase("end", {"a": 1.0, "b": 0.0, "c": 1.0}, {"x": 0.0}))
    flagged = bench.seed_line(bench.SeedResult(1, 60.0, {"start": start, "end": end}, (66.7, 33.3, 3)))
    assert flagged.endswith("1.0 min  ERRORS start 2/3")
    assert start.errors == 2
    assert "(3 episodes, 2 ended by errors (EnvServiceError: 503 busy), babyai" in start.describe()
    clean = bench.seed_line(bench.SeedResult(1, 60.0, {"end": end}, (66.7, 33.3, 3)))
    assert clean.endswith("1.0 min") and "errors" not in end.describe()
