"""Rejection-sampling fine-tuning (``algorithm: rft``, AgentGym's AgentEvol): SFT on the step's successes.

``L = -(1 / |T|) sum_{t in T} log pi(a_t | s_t)`` over T, the action tokens of the successful
trajectories, ``mini_batch_size`` of them per optimiser step, at ``learning_rate``, ``epochs`` passes.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentgym.proto import rl_pb2
from agentgym.trainer.algorithms.sft import sft_step
from agentgym.trainer.batch import SFTExample, TrainBatch, seed_for, shuffled_chunks, trainable
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.policy import Policy

__all__ = ["examples", "update"]


def examples(
    trajectories: Sequence[rl_pb2.Trajectory], *, require_success: bool = True, min_score: float | None = None
) -> list[SFTExample]:
    """The sampled tokens of the successful (or high-scoring) trainable trajectories."""
    return [
        SFTExample.of(t)
        for t in trajectories
        if trainable(t) and (t.success or not require_success) and (min_score is None or t.final_score >= min_score)
    ]


def update(batch: TrainBatch, policy: Policy, options: RLTrainerConfig, step: int) -> dict[str, float]:
    chosen = examples(batch.trajectories)
    out: dict[str, float] = {"rft_examples": float(len(chosen)), "optimizer_steps": 0.0}
    if not chosen:
        return out
    chunks = shuffled_chunks(len(chosen), options.mini_batch_size, options.epochs, seed_for(options.seed, "rft", step))
    history = [sft_step([chosen[i] for i in chunk], policy, options.learning_rate) for chunk in chunks]
    out["optimizer_steps"] = float(len(history))
    out["sft_loss"] = sum(h["sft_loss"] for h in history) / len(history)
    out["grad_norm"] = sum(h["grad_norm"] for h in history) / len(history)
    out["tokens"] = sum(h["tokens"] for h in history)
    return out
