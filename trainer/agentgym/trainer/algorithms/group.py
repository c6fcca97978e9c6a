"""What grpo and rloo share: outcome advantages per group, plus turn- and step-level shaping credit.

``A = scale_negative(A_outcome) + turn_validity_coef * A_validity + step_group_coef * A_step``: the
validity credit compares each turn's action validity with the other turns of its group
(``advantages.turn_validity_advantages``); the step credit compares the discounted returns of turns
that acted from the same observation (GiGPO, ``advantages.step_group_advantages``).
"""

from __future__ import annotations

from torch import Tensor

from agentgym.trainer import advantages as adv
from agentgym.trainer.batch import TrainBatch
from agentgym.trainer.config import RLTrainerConfig

__all__ = ["with_shaping"]


def with_shaping(outcome: Tensor, batch: TrainBatch, options: RLTrainerConfig) -> Tensor:
    """``outcome`` (negative part scaled) plus the configured turn- and step-level credit."""
    c = options
    out = adv.scale_negative_advantages(outcome, c.negative_advantage_scale)
    if c.turn_validity_coef:
        spans, invalid = batch.turn_validity
        success = batch.success if c.turn_validity_needs_success else None
        validity = adv.turn_validity_advantages(
            spans, invalid, batch.group_ids, batch.mask, c.normalize_by_std, success=success
        )
        out = out + c.turn_validity_coef * validity
    if c.step_group_coef:
        spans, states, rewards = batch.turn_states
        step_level = adv.step_group_advantages(
            spans, states, rewards, batch.group_ids, batch.mask, c.step_group_gamma, c.normalize_by_std
        )
        out = out + c.step_group_coef * step_level
    return out
