"""The run's own evaluations play each environment's eval split as the run samples its rollouts."""

from __future__ import annotations

from pathlib import Path

from agentgym.local.run_eval import RunEvalSettings, eval_horizon, eval_settings_for
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
