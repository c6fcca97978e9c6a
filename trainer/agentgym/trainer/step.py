"""One RL step, as stages (:func:`train_step`).

1. Validate and filter (:func:`agentgym.trainer.batch.select`): drop duplicates (trajectory ids seen
   before, in this batch or in earlier steps, including steps before a restart: the recent ids are
   checkpointed) and malformed trajectories (token, mask and logprob lengths disagree, no prompt);
   leave failed ones (TERMINATION_ERROR) out of the loss unless ``train_on_failed``, and so those
   without a sampled token and, with ``drop_uniform_groups``, the groups whose samples all got the
   same outcome (``uniform_groups``). All counted. Rollout statistics are over the well-formed ones.
2. Batch: the trajectories as tensors, groups and rewards (:class:`~agentgym.trainer.batch.TrainBatch`),
   with the step's one :class:`~agentgym.trainer.rewards.RewardConfig`.
3. Update: the algorithm's module (:data:`agentgym.trainer.algorithms.ALGORITHMS`). For the advantage
   estimators (:func:`agentgym.trainer.algorithms.actor.update`): old log-probs (the engine's
   ``sampled_logprobs``, or recomputed with ``recompute_old_logprobs``; either way the step reports
   ``logprob_diff_max`` / ``logprob_diff_mean``, the engine/trainer gap under the same weights) ->
   reference log-probs -> values (PPO's critic) -> advantages -> critic update -> actor update
   (``epochs`` passes over seeded mini-batches; a resumed run makes the same updates).
4. Metrics and schedule: staleness, timing, the step's learning rate (``RLTrainerConfig.learning_rate_at``:
   its warm-up); the horizon schedule is updated with the step's ``success_rate`` and ``truncation_rate``;
   step and policy version go up by one.

Data-parallel (several ranks, DeepSpeed): every rank makes the same calls on the same trajectories;
each forward/backward pass takes only this rank's share of the packed rows, and the step's metrics
are summed over the ranks (``agentgym.trainer.distributed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from agentgym.proto import rl_pb2
from agentgym.trainer.algorithms import ALGORITHMS
from agentgym.trainer.batch import TrainBatch, select
from agentgym.trainer.checkpoint import RecentIds
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.curriculum import HorizonSchedule
from agentgym.trainer.metrics import MetricsSink, flatten_metrics, rollout_metrics
from agentgym.trainer.policy import Policy

log = logging.getLogger(__name__)

__all__ = ["StepMetrics", "Trainer", "train_step"]


@dataclass
class StepMetrics:
    """What one step did. ``env`` holds rollout stats per environment and ``all``; ``train`` the losses."""

    step: int
    policy_version: int
    horizon: int
    stage: int
    env: dict[str, dict[str, float]] = field(default_factory=dict)
    train: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        """The JSON-able record written to ``metrics.jsonl``."""
        return {
            "policy_version": self.policy_version,
            "horizon": self.horizon,
            "stage": self.stage,
            **self.train,
            **{f"count/{k}": v for k, v in self.counts.items()},
            "env": self.env,
        }

    def flat(self) -> dict[str, float]:
        return flatten_metrics(self.as_record())


class Trainer(Protocol):
    """The trainer state a step reads and advances (``RLTrainer``)."""

    config: RLTrainerConfig
    models: Policy
    schedule: HorizonSchedule
    seen_ids: RecentIds
    step: int
    policy_version: int
    last_metrics: dict[str, float]
    sink: MetricsSink | None


def train_step(
    trainer: Trainer, trajectories: Sequence[rl_pb2.Trajectory], extra_counts: dict[str, int] | None = None
) -> StepMetrics:
    """One RL update from ``trajectories`` (see the module docstring); the step's metrics."""
    c = trainer.config
    started = time.perf_counter()
    step = trainer.step
    rewards = c.reward_config()  # once per step: every stage reads this one
    learning_rate = c.learning_rate_at(step)

    # 1. validate / filter
    selection = select(
        trajectories,
        trainer.seen_ids,
        rewards,
        train_on_failed=c.train_on_failed,
        drop_uniform_groups=c.drop_uniform_groups,
    )
    env_stats = rollout_metrics(selection.valid, rewards)

    # 2. batch, 3. update (old log-probs -> reference -> values -> advantages -> critic -> actor)
    train: dict[str, float] = {}
    if selection.used:
        batch = TrainBatch.build(selection.used, rewards, selection.group_ids)
        # The step's learning rate (the warm-up's): the optimiser's for the update, and the options' for the
        # updates that set their own (rft, dpo).
        options = c if learning_rate == c.learning_rate else replace(c, learning_rate=learning_rate)
        with trainer.models.learning_rate(learning_rate):
            train = ALGORITHMS[c.algorithm].update(batch, trainer.models, options, step)
    else:
        log.warning("step %d: no trajectory to train on (%d received)", step, len(trajectories))

    # 4. metrics and schedule
    staleness = [float(trainer.policy_version - t.policy_version) for t in selection.valid]
    train["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
    train["step_time_s"] = time.perf_counter() - started
    train["learning_rate"] = learning_rate
    horizon_used, stage_used = trainer.schedule.current_horizon, trainer.schedule.stage
    all_stats = env_stats.get("all", {})
    trainer.schedule.update(
        step,
        {
            "success_rate": float(all_stats.get("success_rate", 0.0)),
            "truncation_rate": float(all_stats.get("truncation_rate", 0.0)),
            "reward_mean": float(all_stats.get("reward_mean", 0.0)),
        },
    )
    trainer.seen_ids.update(t.trajectory_id for t in selection.fresh if t.trajectory_id)
    trainer.step += 1
    trainer.policy_version += 1
    metrics = StepMetrics(
        step=step,
        policy_version=trainer.policy_version,
        horizon=horizon_used,
        stage=stage_used,
        env=env_stats,
        train=train,
        counts={**selection.counts, **(extra_counts or {})},
    )
    trainer.last_metrics = metrics.flat()
    if trainer.sink is not None:
        trainer.sink.write(step, {**metrics.as_record(), "next_horizon": trainer.schedule.current_horizon})
    return metrics
