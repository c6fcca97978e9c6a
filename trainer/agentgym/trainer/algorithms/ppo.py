"""PPO with a separate critic (Schulman et al. 2017; verl / AgentGym-RL's layout): GAE advantages.

Over the sampled tokens ``s_1 < ... < s_n`` of a trajectory, token rewards ``r`` (minus
``kl_coef * KL`` with ``kl_as == "reward"``) and the critic's values ``V`` (``critic.py``)::

    delta_k = r_k + gamma * V_{k+1} - V_k                 (V_{n+1} = 0)
    A_k     = delta_k + gamma * lam * A_{k+1};   R_k = A_k + V_k
    A       = scale_negative(whiten(A))

The policy is trained by the clipped update of :mod:`.actor`; the critic, per mini-batch, on the
clipped value loss ``1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` with its own
optimiser (:func:`update_critic`).
"""

from __future__ import annotations

from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from agentgym.trainer import advantages as adv
from agentgym.trainer.algorithms.actor import Advantages, Means, MiniBatch
from agentgym.trainer.algorithms.actor import update as clipped_update
from agentgym.trainer.batch import TrainBatch
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.losses import kl_penalty, value_loss
from agentgym.trainer.policy import Policy

__all__ = ["advantages", "update", "update_critic"]


def advantages(
    batch: TrainBatch, old: Tensor, ref: Tensor | None, policy: Policy, options: RLTrainerConfig
) -> Advantages:
    c = options
    rewards = batch.token_rewards
    if c.kl_as == "reward" and ref is not None:
        rewards = adv.kl_penalized_rewards(rewards, batch.mask, kl_penalty(old, ref, c.kl_type) * batch.mask, c.kl_coef)
    values = policy.values_of(batch)
    advantages, returns = adv.gae_advantages(rewards, values, batch.mask, c.gamma, c.lam)
    return Advantages(adv.scale_negative_advantages(advantages, c.negative_advantage_scale), returns, values)


def update_critic(
    batch: TrainBatch,
    policy: Policy,
    options: RLTrainerConfig,
    steps: list[MiniBatch],
    targets: Advantages,
    means: Means,
) -> list[float]:
    """One critic optimiser step per mini-batch on the clipped value loss; the grad norms."""
    c = options
    critic, engine = policy.critic, policy.critic_engine
    assert critic is not None and engine is not None and targets.returns is not None and targets.values is not None
    norms: list[float] = []
    for mb in steps:
        mine = policy.my_rows(mb.rows)
        for r, entry in enumerate(mine):
            if entry is None:  # the critic trains outside DeepSpeed: its gradients are summed below
                continue
            row, idx = entry
            width = max(batch.lengths[b] for b in idx)
            values = pad_sequence(critic.values(row, policy.autocast_dtype), batch_first=True)[:, :width]
            m = batch.mask[idx, :width].to(values.device)
            loss, stats = value_loss(
                values,
                targets.values[idx, :width].to(values.device),
                targets.returns[idx, :width].to(values.device),
                m,
                clip_range=c.value_clip,
                aggregation=c.loss_aggregation,
            )
            engine.backward(loss * mb.weight(m, c.loss_aggregation), r == len(mine) - 1)
            row_tokens = float(m.sum())
            means.add("value_loss", float(loss.detach()), row_tokens)
            for name, value in stats.as_dict().items():
                means.add(name if name.startswith("value") else f"value_{name}", value, row_tokens)
        policy.dp.sum_gradients(critic.parameters())
        norms.append(engine.step())
    return norms


def update(batch: TrainBatch, policy: Policy, options: RLTrainerConfig, step: int) -> dict[str, float]:
    return clipped_update(batch, policy, options, step, advantages, update_critic)
