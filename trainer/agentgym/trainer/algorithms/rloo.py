"""RLOO (Ahmadian et al. 2024): each trajectory's score against the mean of the OTHER samples of its task.

For trajectory ``i`` of a group of ``n`` with scores ``r``::

    A_i = r_i - (sum_g(r) - r_i) / (n - 1)

on every sampled token of ``i``, plus the shaping credit of :mod:`.group`; trained by the clipped
update of :mod:`.actor`.
"""

from __future__ import annotations

from torch import Tensor

from agentgym.trainer import advantages as adv
from agentgym.trainer.algorithms.actor import Advantages
from agentgym.trainer.algorithms.actor import update as clipped_update
from agentgym.trainer.algorithms.group import with_shaping
from agentgym.trainer.batch import TrainBatch
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.policy import Policy

__all__ = ["advantages", "update"]


def advantages(
    batch: TrainBatch, old: Tensor, ref: Tensor | None, policy: Policy, options: RLTrainerConfig
) -> Advantages:
    outcome = adv.rloo_advantages(batch.scores, batch.group_ids, batch.mask)
    return Advantages(with_shaping(outcome, batch, options))


def update(batch: TrainBatch, policy: Policy, options: RLTrainerConfig, step: int) -> dict[str, float]:
    return clipped_update(batch, policy, options, step, advantages)
