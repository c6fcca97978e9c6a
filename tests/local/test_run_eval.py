"""The run's own evaluations play each environment's eval split as the run samples its rollouts."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from agentgym.local import evaluate as evaluate_module
from agentgym.local.evaluate import EvalSettings
from agentgym.local.run_eval import (
    PhaseResult,
    RunEvalSettings,
    eval_horizon,
    eval_settings_for,
    evaluate_served_policy,
    paired_gain,
)
from agentgym.spec import load_training_run

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def test_eval_samples_with_the_runs_temperature_and_top_p() -> None:
    spec = load_training_run(QUICKSTART).spec
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"temperature": 0.7, "top_p": 0.9})})
    env = spec.environments[0]
    settings = eval_settings_for(spec, env, RunEvalSettings(tasks=10, samples=2), eval_horizon(spec))
    assert (settings.temperature, settings.top_p) == (0.7, 0.9)
    assert (settings.environment, settings.split) == ("babyai", "test-easy")
    assert (settings.tasks, settings.samples, settings.max_turns) == (10, 2, [5])  # the last ScalingInter stage
    assert settings.max_tokens_per_turn == spec.rollout.max_tokens_per_turn
    # The rollout workers keep their slots: maxEpisodes 128 less 32 of rollout leaves 96; the engine batch caps it.
    assert settings.concurrency == min(spec.inference.max_batch_size, 128 - 32)


def test_each_environment_is_evaluated_at_its_final_horizon() -> None:
    spec = load_training_run(QUICKSTART).spec
    textcraft = spec.environments[0].model_copy(update={"name": "textcraft", "horizons": [4, 6, 8]})
    spec = spec.model_copy(update={"environments": [spec.environments[0], textcraft]})
    assert (eval_horizon(spec), eval_horizon(spec, "babyai"), eval_horizon(spec, "textcraft")) == (5, 5, 8)
    result = PhaseResult(
        "end",
        3,
        5,
        0.5,
        0.1,
        8,
        4,
        1.0,
        {"babyai": {"split": "test-easy", "horizon": 5}, "textcraft": {"split": "test-shallow", "horizon": 8}},
    )
    assert result.where() == "babyai test-easy (horizon 5), textcraft test-shallow (horizon 8)"
    one = PhaseResult("end", 3, 5, 0.5, 0.1, 8, 4, 1.0, {"babyai": {"split": "test-easy", "horizon": 5}})
    assert one.where() == "babyai test-easy, horizon 5"


def test_the_environments_are_evaluated_at_once_and_reported_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_training_run(QUICKSTART.parent / "babyai-textcraft-cpu.yaml").spec
    events: list[tuple[str, str]] = []

    async def play_split(settings: EvalSettings, inference_url: str, env_url: str, chat: Any) -> dict[str, Any]:
        events.append(("start", settings.environment))
        await asyncio.sleep(0.05 if settings.environment == "babyai" else 0.01)  # babyai ends last
        events.append(("end", settings.environment))
        turns = str(settings.max_turns[0])
        success = 1.0 if settings.environment == "babyai" else 0.0
        return {"by_max_turns": {turns: {"episodes": 4, "tasks": 4, "success": success, "success_se": 0.0}}}

    monkeypatch.setattr(evaluate_module, "play_split", play_split)
    urls = {"babyai": "http://babyai", "textcraft": "http://textcraft"}
    result = asyncio.run(
        evaluate_served_policy(spec, "end", 3, "http://inference", urls, None, RunEvalSettings(tasks=4))  # type: ignore[arg-type]
    )
    assert [kind for kind, _ in events[:2]] == ["start", "start"], events  # both play before either ends
    assert list(result.environments) == ["babyai", "textcraft"]  # the spec's order, not the order they ended in
    assert result.environments["babyai"]["success"] == 1.0 and result.environments["textcraft"]["success"] == 0.0
    assert (result.environments["babyai"]["horizon"], result.environments["textcraft"]["horizon"]) == (5, 8)
    assert result.success == 0.5 and result.episodes == 8


def _phase(name: str, per_env: dict[str, dict[str, float]]) -> PhaseResult:
    environments = {env: {"task_success": tasks} for env, tasks in per_env.items()}
    return PhaseResult(name, 0, 5, 0.0, 0.0, 0, 0, 0.0, environments)


def test_paired_gain_compares_task_by_task() -> None:
    before = _phase("start", {"babyai": {"a": 0.0, "b": 0.5, "c": 1.0}, "textcraft": {"x": 0.0}})
    # "d" was not played before and is left out; differences: a +1, b +0, c -0.5, x +1.
    after = _phase("end", {"babyai": {"a": 1.0, "b": 0.5, "c": 0.5, "d": 1.0}, "textcraft": {"x": 1.0}})
    points, se, tasks = paired_gain(before, after)
    assert tasks == 4
    assert points == pytest.approx(100 * 1.5 / 4)
    # sd of (1, 0, -0.5, 1) about 0.375: sqrt((0.390625 + 0.140625 + 0.765625 + 0.390625) / 3) = 0.75; / sqrt(4).
    assert se == pytest.approx(100 * 0.75 / 2)


def test_paired_gain_without_shared_tasks() -> None:
    points, se, tasks = paired_gain(_phase("start", {"babyai": {}}), _phase("end", {"babyai": {"a": 1.0}}))
    assert tasks == 0 and math.isnan(points) and math.isnan(se)
    assert paired_gain(_phase("start", {"babyai": {"a": 0.0}}), _phase("end", {"babyai": {"a": 1.0}}))[1] == 0.0
