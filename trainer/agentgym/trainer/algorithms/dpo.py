"""Online DPO (``algorithm: dpo``, Rafailov et al. 2023): each group's best trajectory against its worst.

With sequence log-probs ``log pi(y)`` (summed over the sampled tokens) of chosen ``c`` and rejected
``r`` under the policy and the frozen reference::

    h = (log pi(c) - log pi_ref(c)) - (log pi(r) - log pi_ref(r))
    L = -mean(log sigmoid(beta * h))

``mini_batch_size / 2`` pairs per optimiser step, ``epochs`` passes (``losses.dpo_loss``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from agentgym.proto import rl_pb2
from agentgym.trainer.batch import DPOPair, SFTExample, TrainBatch, example_batch, seed_for, shuffled_chunks, trainable
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.losses import dpo_loss
from agentgym.trainer.policy import Policy

__all__ = ["dpo_step", "pairs", "update"]


def pairs(trajectories: Sequence[rl_pb2.Trajectory]) -> list[DPOPair]:
    """Per group: the best trajectory (by score, success first) against the worst, when they differ."""
    groups: dict[str, list[rl_pb2.Trajectory]] = {}
    for t in trajectories:
        if trainable(t):
            groups.setdefault(t.group_id or t.task_id, []).append(t)
    out = []
    for key in sorted(groups):
        ranked = sorted(groups[key], key=lambda t: (t.success, t.final_score), reverse=True)
        best, worst = ranked[0], ranked[-1]
        if (best.success, best.final_score) != (worst.success, worst.final_score):
            out.append(DPOPair(SFTExample.of(best, with_task=False), SFTExample.of(worst, with_task=False)))
    return out


def dpo_step(chosen_rejected: Sequence[DPOPair], policy: Policy, beta: float, learning_rate: float) -> dict[str, float]:
    """One optimiser step on ``chosen_rejected``."""
    if not chosen_rejected:
        raise ValueError("dpo_step needs at least one pair")
    reference = policy.reference_model()
    batch = example_batch([p.chosen for p in chosen_rejected] + [p.rejected for p in chosen_rejected])
    n = len(chosen_rejected)
    ref_lp = (policy.logprobs_of(reference, batch) * batch.mask).sum(dim=1)
    with policy.learning_rate(learning_rate):
        seq_lp: list[Tensor] = [torch.zeros(())] * batch.size
        # DPO couples chosen and rejected through the sigmoid: forward all rows, then one backward.
        for row, idx in policy.pack(batch, range(batch.size)):
            out = policy.forward(policy.model, row, with_entropy=False)
            for b, lp in zip(idx, out.logprobs, strict=True):
                seq_lp[b] = (lp * batch.mask[b, : batch.lengths[b]].to(lp.device)).sum()
        stacked = torch.stack(seq_lp)
        dev = stacked.device
        loss, r_c, r_r = dpo_loss(stacked[:n], stacked[n:], ref_lp[:n].to(dev), ref_lp[n:].to(dev), beta=beta)
        policy.engine.backward(loss, True)
        grad_norm = policy.engine.step()
    return {
        "dpo_loss": float(loss.detach()),
        "reward_margin": float((r_c - r_r).mean()),
        "reward_accuracy": float((r_c > r_r).float().mean()),
        "grad_norm": grad_norm,
    }


def update(batch: TrainBatch, policy: Policy, options: RLTrainerConfig, step: int) -> dict[str, float]:
    chosen = pairs(batch.trajectories)
    out: dict[str, float] = {"dpo_pairs": float(len(chosen)), "optimizer_steps": 0.0}
    if not chosen:
        return out
    size = max(1, options.mini_batch_size // 2)
    chunks = shuffled_chunks(len(chosen), size, options.epochs, seed_for(options.seed, "dpo", step))
    history = [
        dpo_step([chosen[i] for i in chunk], policy, options.dpo_beta, options.learning_rate) for chunk in chunks
    ]
    out["optimizer_steps"] = float(len(history))
    for name in ("dpo_loss", "reward_margin", "reward_accuracy", "grad_norm"):
        out[name] = sum(h[name] for h in history) / len(history)
    return out
