"""RLTrainerConfig from TrainingRun specs, validation, and the trainer entrypoint's config sources."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentgym.spec import load_training_run, parse_training_run
from agentgym.trainer.config import EnvironmentConfig, RLTrainerConfig
from agentgym.trainer.curriculum import AdaptiveHorizon, FixedHorizon, ScalingInterSchedule
from agentgym.trainer.entrypoint import config_from_args
from agentgym.trainer.trainer import RLTrainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_from_spec_maps_every_field_group() -> None:
    from agentgym.spec import parse_training_run

    run = parse_training_run(
        {
            "metadata": {"name": "quick"},
            "spec": {
                "model": {"name": "builtin:tiny", "maxContextTokens": 2048},
                "environments": [{"name": "babyai", "split": "train-easy", "config": {"list_actions": False}}],
                "algorithm": {
                    "name": "grpo",
                    "groupSize": 8,
                    "learningRate": 1e-4,
                    "invalidActionPenalty": 0.1,
                    "turnValidityCoef": 0.5,
                    "turnValidityNeedsSuccess": False,
                    "negativeAdvantageScale": 0.25,
                    "stepGroupCoef": 1.0,
                    "stepGroupGamma": 0.9,
                },
                "curriculum": {"kind": "scaling_inter", "horizons": [4, 8, 12], "stageSteps": 10},
                "trainer": {
                    "totalSteps": 30,
                    "checkpointEvery": 5,
                    "sftWarmupSteps": 40,
                    "sftLearningRate": 1e-3,
                    "sftTasks": 96,
                    "sftBatchSize": 4,
                    "sftThoughts": False,
                },
                "storage": {"checkpointUri": "file://runs/quickstart"},
            },
        }
    )
    config = RLTrainerConfig.from_spec(run.spec, run=run.metadata.name)
    assert config.output_dir == Path("runs/quickstart/quick")
    assert (config.algorithm, config.group_size, config.learning_rate) == ("grpo", 8, 1e-4)
    assert config.environments == [
        EnvironmentConfig("babyai", "train-easy", 1.0, None, {"list_actions": False}, horizons=[4, 8, 12])
    ]
    assert (config.total_steps, config.checkpoint_every, config.sft_warmup_steps) == (30, 5, 40)
    assert (config.sft_learning_rate, config.sft_tasks, config.sft_batch_size) == (1e-3, 96, 4)
    assert config.sft_thoughts is False
    assert config.reward_config().invalid_action_penalty == 0.1
    assert (config.turn_validity_coef, config.negative_advantage_scale) == (0.5, 0.25)
    assert config.turn_validity_needs_success is False  # the default is True
    assert (config.step_group_coef, config.step_group_gamma) == (1.0, 0.9)
    assert config.to_dict()["environments"][0]["config"] == {"list_actions": False}
    assert config.max_context_tokens == 2048
    schedule = config.build_schedule()
    assert isinstance(schedule, ScalingInterSchedule)
    assert [schedule.horizon(s) for s in (0, 9, 10, 20)] == [4, 4, 8, 12]


def test_the_quickstart_example_maps() -> None:
    run = load_training_run(EXAMPLES / "quickstart.yaml")
    config = RLTrainerConfig.from_spec(run.spec, run=run.metadata.name)
    assert config.environments[0].name == "babyai" and config.total_steps == run.spec.trainer.total_steps


def test_each_environment_keeps_its_horizons_per_stage() -> None:
    """ScalingInter stages are the run's (the first environment's stage length); each environment plays its own
    horizon of the stage, which the trainer hands the publisher per environment."""
    run = parse_training_run(
        {
            "apiVersion": "agentgym.io/v1alpha1",
            "kind": "TrainingRun",
            "metadata": {"name": "mixed"},
            "spec": {
                "model": {"name": "builtin:tiny"},
                "environments": [{"name": "babyai"}, {"name": "textcraft", "horizons": [4, 6, 8]}],
                "curriculum": {"horizons": [2, 3, 5], "stageSteps": 4},
            },
        }
    )
    config = RLTrainerConfig.from_spec(run.spec, output_dir="x")
    assert [(e.name, e.horizons) for e in config.environments] == [("babyai", [2, 3, 5]), ("textcraft", [4, 6, 8])]
    trainer = SimpleNamespace(config=config, schedule=config.build_schedule())
    by_step = [RLTrainer.horizons_at(trainer, step) for step in (0, 3, 4, 8, 50)]  # type: ignore[arg-type]
    assert by_step == [
        {"babyai": 2, "textcraft": 4},
        {"babyai": 2, "textcraft": 4},
        {"babyai": 3, "textcraft": 6},
        {"babyai": 5, "textcraft": 8},
        {"babyai": 5, "textcraft": 8},
    ]
    fixed = run.spec.model_copy(
        update={
            "curriculum": run.spec.curriculum.model_copy(update={"kind": "fixed", "max_turns": 7}),
            "environments": [e.model_copy(update={"horizons": None}) for e in run.spec.environments],
        }
    )
    config = RLTrainerConfig.from_spec(fixed, output_dir="x")
    trainer = SimpleNamespace(config=config, schedule=config.build_schedule())
    assert RLTrainer.horizons_at(trainer, 9) == {"babyai": 7, "textcraft": 7}  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="environment textcraft: 2 horizons for 3 curriculum stages"):
        RLTrainerConfig(
            curriculum={"kind": "scaling_inter", "horizons": [2, 3, 5]},
            environments=[EnvironmentConfig("babyai"), EnvironmentConfig("textcraft", horizons=[4, 8])],
        )
    with pytest.raises(ValueError, match="environment horizons need a scaling_inter curriculum"):
        RLTrainerConfig(environments=[EnvironmentConfig("babyai", horizons=[4, 8])])


def test_curriculum_kinds_from_spec() -> None:
    run = load_training_run(EXAMPLES / "textcraft-paper.yaml")
    fixed = run.spec.model_copy(update={"curriculum": run.spec.curriculum.model_copy(update={"kind": "fixed"})})
    schedule = RLTrainerConfig.from_spec(fixed, output_dir="x").build_schedule()
    assert isinstance(schedule, FixedHorizon) and schedule.current_horizon == 30  # last paper stage
    spec = run.spec.model_dump(by_alias=True)
    spec["curriculum"] = {"kind": "adaptive", "adaptive": {"initial": 5, "maximum": 25}}
    from agentgym.spec import TrainingRunSpec

    adaptive = RLTrainerConfig.from_spec(TrainingRunSpec.model_validate(spec), output_dir="x").build_schedule()
    assert isinstance(adaptive, AdaptiveHorizon) and adaptive.current_horizon == 5 and adaptive.maximum == 25


def test_validation() -> None:
    with pytest.raises(ValueError, match="group_size"):
        RLTrainerConfig(algorithm="grpo", group_size=1)
    with pytest.raises(ValueError, match="kl_as"):
        RLTrainerConfig(algorithm="grpo", kl_as="reward")
    RLTrainerConfig(algorithm="ppo", kl_as="reward", group_size=1)
    with pytest.raises(ValueError, match="turn_validity_coef must be >= 0"):
        RLTrainerConfig(algorithm="grpo", turn_validity_coef=-0.5)
    with pytest.raises(ValueError, match="turn_validity_coef is for the group estimators"):
        RLTrainerConfig(algorithm="ppo", group_size=1, turn_validity_coef=0.5)
    RLTrainerConfig(algorithm="rloo", turn_validity_coef=0.5)
    with pytest.raises(ValueError, match="step_group_coef must be >= 0"):
        RLTrainerConfig(algorithm="grpo", step_group_coef=-1.0)
    with pytest.raises(ValueError, match="step_group_gamma must be in"):
        RLTrainerConfig(algorithm="grpo", step_group_coef=1.0, step_group_gamma=1.2)
    with pytest.raises(ValueError, match="step_group_coef is for the group estimators"):
        RLTrainerConfig(algorithm="ppo", group_size=1, step_group_coef=1.0)
    RLTrainerConfig(algorithm="rloo", step_group_coef=1.0)
    with pytest.raises(ValueError, match="drop_uniform_groups is for the group estimators"):
        RLTrainerConfig(algorithm="reinforce_plus_plus", group_size=1, drop_uniform_groups=True)
    with pytest.raises(ValueError, match="drop_uniform_groups needs an outcome reward"):
        RLTrainerConfig(algorithm="grpo", drop_uniform_groups=True, outcome_reward="none")
    RLTrainerConfig(algorithm="rloo", drop_uniform_groups=True)
    with pytest.raises(ValueError, match="negative_advantage_scale must be in"):
        RLTrainerConfig(algorithm="grpo", negative_advantage_scale=1.5)
    with pytest.raises(ValueError, match="outcome"):
        RLTrainerConfig(outcome_reward="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_size must be >= 2 for dpo"):
        RLTrainerConfig(algorithm="dpo", group_size=1)  # a pair needs two samples of a task
    with pytest.raises(ValueError, match="dpo_beta must be > 0"):
        RLTrainerConfig(algorithm="dpo", dpo_beta=0.0)
    RLTrainerConfig(algorithm="rft", group_size=1)
    # The reference: the KL term's (not rft's, whatever klCoef says) and DPO's anchor (whatever klCoef says)
    assert not RLTrainerConfig(algorithm="rft", kl_coef=0.1).uses_reference
    assert RLTrainerConfig(algorithm="dpo", kl_coef=0.0).uses_reference
    assert RLTrainerConfig(algorithm="grpo", kl_coef=0.1).uses_reference
    assert not RLTrainerConfig(algorithm="grpo", kl_coef=0.0).uses_reference


def test_rft_and_dpo_from_spec() -> None:
    from agentgym.spec import SpecError, parse_training_run

    def spec(algorithm: dict[str, object]) -> dict[str, object]:
        body = {"model": {"name": "builtin:tiny"}, "environments": [{"name": "babyai"}], "algorithm": algorithm}
        return {"metadata": {"name": "aux"}, "spec": body}

    dpo = RLTrainerConfig.from_spec(parse_training_run(spec({"name": "dpo", "dpoBeta": 0.3})).spec, run="aux")
    assert (dpo.algorithm, dpo.dpo_beta) == ("dpo", 0.3)
    rft = RLTrainerConfig.from_spec(parse_training_run(spec({"name": "rft", "groupSize": 1})).spec, run="aux")
    assert rft.algorithm == "rft"
    with pytest.raises(SpecError, match="groupSize must be >= 2 for dpo"):
        parse_training_run(spec({"name": "dpo", "groupSize": 1}))


def test_entrypoint_reads_a_run_file_or_a_json_config(tmp_path: Path) -> None:
    args = argparse.Namespace(run=EXAMPLES / "quickstart.yaml", config=None, output_dir=tmp_path, run_name=None)
    config, url = config_from_args(args)
    assert config.run == "quickstart" and config.output_dir == tmp_path and url is None

    dumped = tmp_path / "trainer.json"
    dumped.write_text(json.dumps(config.to_dict()))
    args = argparse.Namespace(run=None, config=dumped, output_dir=None, run_name="again")
    again, _ = config_from_args(args)
    assert again.run == "again"
    assert {**again.to_dict(), "run": "quickstart"} == config.to_dict()
