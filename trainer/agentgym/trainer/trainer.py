"""``RLTrainer``: the trainer's state and its public calls; the work is done by the modules it names.

Usable without NATS (the local runner drives it in-process)::

    trainer = RLTrainer(RLTrainerConfig(model="builtin:tiny", output_dir="runs/demo", group_size=4))
    trainer.maybe_resume()                          # latest checkpoint under runs/demo/checkpoints
    metrics = trainer.train_step(trajectories)      # -> StepMetrics; step += 1, policy_version += 1
    path = trainer.save_checkpoint()                # runs/demo/checkpoints/step-<n>/
    trainer.current_policy_dir                      # the HF folder inference should serve now

Where things are: the step's stages in ``agentgym.trainer.step``; the typed batch in
``agentgym.trainer.batch``; one module per algorithm in ``agentgym.trainer.algorithms``; the models
(policy, reference, critic, tokenizer), devices and packed forwards in ``agentgym.trainer.policy``;
checkpoints in ``agentgym.trainer.checkpoint``; data parallelism in ``agentgym.trainer.distributed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from agentgym.proto import rl_pb2
from agentgym.trainer import checkpoint
from agentgym.trainer.algorithms import ALGORITHMS, actor, dpo, rft
from agentgym.trainer.algorithms.sft import sft_step
from agentgym.trainer.backend import PolicyEngine, TorchEngine
from agentgym.trainer.batch import DPOPair, SFTExample, TrainBatch, group_key, mini_batch_order, seed_for, unseen
from agentgym.trainer.checkpoint import RecentIds
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.critic import ValueModel
from agentgym.trainer.curriculum import ScalingInterSchedule
from agentgym.trainer.distributed import DataParallel
from agentgym.trainer.metrics import MetricsSink
from agentgym.trainer.policy import Policy, cpu_has_bf16_units
from agentgym.trainer.step import StepMetrics, train_step

log = logging.getLogger(__name__)

__all__ = ["DPOPair", "RLTrainer", "SFTExample", "StepMetrics", "cpu_has_bf16_units", "group_key", "mini_batch_order"]


class RLTrainer:
    """The models (:attr:`models`), the schedule, the step counter and policy version, the metrics sink."""

    def __init__(
        self,
        config: RLTrainerConfig,
        *,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        metrics_sink: MetricsSink | None = None,
        write_metrics: bool = True,
        data_parallel: DataParallel | None = None,
    ) -> None:
        self.config = config
        self.dp = data_parallel or DataParallel()
        if self.dp.enabled and config.backend != "deepspeed":
            raise ValueError(f"data-parallel training over {self.dp.world_size} ranks needs backend 'deepspeed'")
        self.models = Policy(config, self.dp, model=model, tokenizer=tokenizer)
        self.schedule = config.build_schedule()
        self.seen_ids = RecentIds(config.recent_ids_capacity)
        self.step = 0
        self.policy_version = 0
        self.sft_done = False
        self.last_checkpoint: Path | None = None
        self.last_metrics: dict[str, float] = {}
        self.policy_dir: Path | None = self.models.model_folder
        if not self.dp.is_main:  # rank 0 reports for all ranks
            metrics_sink, write_metrics = None, False
        if metrics_sink is None and write_metrics:
            metrics_sink = MetricsSink(
                config.run_dir, config.run, tensorboard=config.tensorboard, otel=config.otel_metrics
            )
        self.sink = metrics_sink

    # -- the models (see agentgym.trainer.policy) ------------------------------------------------

    @property
    def policy(self) -> nn.Module:
        return self.models.model

    @property
    def engine(self) -> PolicyEngine:
        return self.models.engine

    @property
    def reference(self) -> nn.Module | None:
        return self.models.reference

    @property
    def critic(self) -> ValueModel | None:
        return self.models.critic

    @property
    def critic_engine(self) -> TorchEngine | None:
        return self.models.critic_engine

    @property
    def tokenizer(self) -> Any:
        return self.models.tokenizer

    @property
    def device(self) -> torch.device:
        return self.models.device

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.models.autocast_dtype

    @property
    def model_folder(self) -> Path | None:
        return self.models.model_folder

    @property
    def reference_dir(self) -> Path | None:
        return self.models.reference_dir

    @property
    def attn_implementation(self) -> str:
        return self.models.attn_implementation

    @property
    def current_policy_dir(self) -> Path | None:
        """The HF folder holding the current policy weights (what inference should load)."""
        return self.policy_dir

    @property
    def horizon(self) -> int:
        """The schedule's horizon now (the first environment's)."""
        return self.schedule.current_horizon

    def horizons_at(self, step: int) -> dict[str, int]:
        """Each environment's max turns at training step ``step``: under ScalingInter its own horizon of the step's
        stage (``EnvironmentConfig.horizons``), otherwise the schedule's (an adaptive schedule knows only now)."""
        schedule = self.schedule
        if isinstance(schedule, ScalingInterSchedule):
            stage = schedule.stage_at(step)
            own = {e.name: e.horizons for e in self.config.environments}
            return {name: horizons[stage] if horizons else schedule.horizons[stage] for name, horizons in own.items()}
        horizon_of = getattr(schedule, "horizon", None)
        horizon = int(horizon_of(step)) if callable(horizon_of) else schedule.current_horizon
        return {e.name: horizon for e in self.config.environments}

    # -- RL ---------------------------------------------------------------------------------------

    def train_step(
        self, trajectories: Sequence[rl_pb2.Trajectory], *, extra_counts: dict[str, int] | None = None
    ) -> StepMetrics:
        """One RL update from ``trajectories`` (``agentgym.trainer.step``). Returns the step's metrics."""
        return train_step(self, trajectories, extra_counts)

    def filter_new(self, trajectories: Sequence[rl_pb2.Trajectory]) -> tuple[list[rl_pb2.Trajectory], int]:
        """Trajectories whose ids were not seen before (nor earlier in the list); and the duplicate count."""
        fresh = unseen(trajectories, self.seen_ids)
        return fresh, len(trajectories) - len(fresh)

    # The two below let tests check an estimator's advantages on a hand-made batch.
    def _batch(self, trajectories: Sequence[rl_pb2.Trajectory]) -> TrainBatch:
        return TrainBatch.build(trajectories, self.config.reward_config())

    def _advantages(
        self, batch: TrainBatch, old: Tensor, ref: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(advantages, returns, old values) ``[B, T]`` of the configured estimator; the last two for PPO only."""
        # Only the estimators' modules define it (the Algorithm protocol is update alone).
        estimate = cast(actor.Estimator, getattr(ALGORITHMS[self.config.algorithm], "advantages"))  # noqa: B009
        out = estimate(batch, old, ref, self.models, self.config)
        return out.advantages, out.returns, out.values

    # -- supervised: SFT warm-up, rejection sampling, DPO ------------------------------------------

    def sft_step(self, examples: Sequence[SFTExample], learning_rate: float | None = None) -> dict[str, float]:
        """One optimiser step of token-mean cross-entropy on the examples' masked-in tokens."""
        return sft_step(
            examples, self.models, self.config.sft_learning_rate if learning_rate is None else learning_rate
        )

    def sft(
        self,
        examples: Sequence[SFTExample],
        steps: int,
        batch_size: int | None = None,
        *,
        mark_done: bool = True,
        reset_optimizer: bool | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[dict[str, float]]:
        """``steps`` SFT optimiser steps over ``examples`` (reshuffled each pass, seeded); bumps the policy version.

        The warm-up (``mark_done``) is a stage of its own: afterwards the optimiser's state is reset
        (``reset_optimizer``, default ``mark_done``), so RL starts with a fresh AdamW. Carried over, the
        SFT's second-moment estimates (cross-entropy gradients, far larger than policy-gradient ones,
        decaying over ~1 / (1 - beta2) = 1000 steps) would shrink every RL update for hundreds of steps,
        and its first moments would push RL's first steps along the SFT's direction.

        ``should_stop`` is asked before every step (a run being stopped); once it answers True the
        warm-up ends there unfinished: not marked done, no new policy version, so a resume redoes it.
        """
        if steps < 0:
            raise ValueError("steps must be >= 0")
        if not examples:
            raise ValueError("no SFT examples")
        size = batch_size or self.config.sft_batch_size
        generator = torch.Generator().manual_seed(seed_for(self.config.seed, "sft", self.policy_version))
        order: list[int] = []
        history: list[dict[str, float]] = []
        for k in range(steps):
            # Rank 0's answer for every rank: they stop together, or none does.
            if self.dp.broadcast(should_stop is not None and should_stop()):
                log.info("SFT stopped after %d of %d steps", k, steps)
                return history
            if len(order) < size:
                order += torch.randperm(len(examples), generator=generator).tolist()
            chosen, order = order[:size], order[size:]
            metrics = self.sft_step([examples[i] for i in chosen])
            metrics["sft_step"] = float(k)
            history.append(metrics)
            if self.sink is not None:
                self.sink.write(self.step, {f"sft/{k2}": v for k2, v in metrics.items()})
        if steps:
            self.policy_version += 1
        if mark_done:
            self.sft_done = True
            if steps:
                self._adopt_policy_as_reference()
        if steps and (mark_done if reset_optimizer is None else reset_optimizer):
            self.engine.reset_optimizer_state()
        return history

    def _adopt_policy_as_reference(self) -> None:
        """After the SFT warm-up the KL anchor is the warmed-up policy, RL's starting point.

        Anchoring to the raw model instead would pull RL back towards what the warm-up just trained
        away (for a model trained from scratch: towards random weights). The reference is saved once
        to ``<output_dir>/reference`` and named in every later checkpoint, so a resume restores it.
        """
        if self.models.reference is None:
            return
        folder = self.config.run_dir / "reference"
        with checkpoint.rank_atomic_directory(self.dp, folder) as tmp:
            self.models.save_hf(tmp)
        self.models.reference = self.models.load_reference(folder)
        self.models.reference_dir = folder

    @staticmethod
    def rejection_sampling_examples(
        trajectories: Sequence[rl_pb2.Trajectory], *, require_success: bool = True, min_score: float | None = None
    ) -> list[SFTExample]:
        """Rejection-sampling fine-tuning data: the sampled tokens of successful (or high-scoring) trajectories."""
        return rft.examples(trajectories, require_success=require_success, min_score=min_score)

    def rejection_sampling_step(self, trajectories: Sequence[rl_pb2.Trajectory]) -> dict[str, float] | None:
        """One SFT step on the successful trajectories (None when there is none)."""
        examples = self.rejection_sampling_examples(trajectories)
        return self.sft_step(examples) if examples else None

    @staticmethod
    def dpo_pairs(trajectories: Sequence[rl_pb2.Trajectory]) -> list[DPOPair]:
        """Per group: the best trajectory (by score, success first) against the worst, when they differ."""
        return dpo.pairs(trajectories)

    def dpo_step(
        self, pairs: Sequence[DPOPair], beta: float = 0.1, learning_rate: float | None = None
    ) -> dict[str, float]:
        """One DPO optimiser step on trajectory pairs (sequence log-prob = sum over sampled tokens)."""
        lr = self.config.learning_rate if learning_rate is None else learning_rate
        return dpo.dpo_step(pairs, self.models, beta, lr)

    # -- checkpoints and weights (see agentgym.trainer.checkpoint) ---------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The JSON-able trainer state (``trainer_state.json``)."""
        return checkpoint.state_dict(self)

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Save ``<directory>/step-<step>/`` atomically (default ``<output_dir>/checkpoints``), prune old ones."""
        return checkpoint.save_checkpoint(self, directory)

    def export_weights(self, directory: str | Path | None = None) -> Path:
        """Write the current policy (HF folder) to ``<directory>/version-<policy_version>`` for inference."""
        return checkpoint.export_weights(self, directory)

    def load_checkpoint(self, directory: str | Path) -> Path:
        """Restore from a ``step-<n>`` folder, or the newest one under ``directory``; returns the folder."""
        return checkpoint.load_checkpoint(self, directory)

    def maybe_resume(self, directory: str | Path | None = None) -> Path | None:
        """Load the newest checkpoint under ``directory`` (default: the run's) if there is one."""
        return checkpoint.maybe_resume(self, directory)

    def renumber_policy(self, version: int) -> None:
        """Give the current weights a higher policy version: after a resume from a checkpoint older than the
        last version published (weights-only exports since then were lost with the process), so versions only
        go up and no server or status takes the checkpoint's weights for an older or a lost policy."""
        if version < self.policy_version:
            raise ValueError(f"policy versions only go up: {version} < {self.policy_version}")
        self.policy_version = version

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
