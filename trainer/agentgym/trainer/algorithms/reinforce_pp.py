"""REINFORCE++ (Hu 2025): discounted returns of token rewards, whitened over the batch; no critic.

Over the sampled tokens ``s_1 < ... < s_n`` of a trajectory, token rewards ``r`` (``rewards.py``)
and, with ``kl_as == "reward"``, the per-token KL to the reference::

    G_k = (r_k - kl_coef * KL_k) + gamma * G_{k+1}
    A   = scale_negative((G - mean(G)) / std(G))        (mean and std over all sampled tokens)

trained by the clipped update of :mod:`.actor`.
"""

from __future__ import annotations

from torch import Tensor

from agentgym.trainer import advantages as adv
from agentgym.trainer.algorithms.actor import Advantages
from agentgym.trainer.algorithms.actor import update as clipped_update
from agentgym.trainer.batch import TrainBatch
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.losses import kl_penalty
from agentgym.trainer.policy import Policy

__all__ = ["advantages", "update"]


def advantages(
    batch: TrainBatch, old: Tensor, ref: Tensor | None, policy: Policy, options: RLTrainerConfig
) -> Advantages:
    c = options
    kl = kl_penalty(old, ref, c.kl_type) * batch.mask if c.kl_as == "reward" and ref is not None else None
    returns = adv.reinforce_plus_plus_advantages(
        batch.token_rewards, batch.mask, c.gamma, kl, c.kl_coef if kl is not None else 0.0
    )
    return Advantages(adv.scale_negative_advantages(returns, c.negative_advantage_scale))


def update(batch: TrainBatch, policy: Policy, options: RLTrainerConfig, step: int) -> dict[str, float]:
    return clipped_update(batch, policy, options, step, advantages)
