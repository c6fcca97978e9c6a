"""The update every advantage estimator (grpo, rloo, reinforce_pp, ppo) trains the policy with.

Stages, in order: old log-probs -> reference log-probs -> advantages (the estimator; PPO reads its
critic's values here) -> critic update (PPO) -> actor update -> metrics. The actor update makes
``epochs`` passes over seeded mini-batches of ``mini_batch_size`` trajectories, one optimiser step per
mini-batch, one forward/backward per packed row. Per sampled token, ``rho = pi(a|s) / pi_old(a|s)``::

    L = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))   (dual clip: min(L, -c A) where A < 0)
        - entropy_coef * H  +  kl_coef * KL(pi || pi_ref)        (KL here when kl_as == "loss")

aggregated with ``loss_aggregation`` over the mini-batch (``agentgym.trainer.losses``). Each packed
row's loss is weighted by its share of the mini-batch's tokens (or sequences), so the accumulated
gradient is that of the whole mini-batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from agentgym.trainer.batch import TrainBatch, mini_batch_order, seed_for
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.losses import aggregate_loss, kl_loss, policy_loss
from agentgym.trainer.policy import Policy, Rows

__all__ = ["Advantages", "Estimator", "Means", "MiniBatch", "update"]


@dataclass
class Advantages:
    """An estimator's output, ``[B, T]`` on sampled tokens."""

    advantages: Tensor
    returns: Tensor | None = None
    """PPO: the critic's targets."""
    values: Tensor | None = None
    """PPO: the critic's values before the update (the value clip's anchor)."""


Estimator = Callable[[TrainBatch, Tensor, "Tensor | None", Policy, RLTrainerConfig], Advantages]
"""``(batch, old log-probs, reference log-probs or None, policy, options) -> Advantages``."""

CriticUpdate = Callable[[TrainBatch, Policy, RLTrainerConfig, "list[MiniBatch]", Advantages, "Means"], list[float]]
"""``(batch, policy, options, mini-batches, advantages, means) -> critic grad norms`` (PPO's)."""


@dataclass
class Means:
    """Weighted means of per-row statistics, summed over the ranks by :meth:`gathered`."""

    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float, weight: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value * weight
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def merge(self, other: Means) -> None:
        for name, total in other.sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + total
            self.weights[name] = self.weights.get(name, 0.0) + other.weights[name]

    def means(self) -> dict[str, float]:
        return {name: total / w if (w := self.weights[name]) else 0.0 for name, total in self.sums.items()}


@dataclass
class MiniBatch:
    """One optimiser step's trajectories, packed."""

    members: list[int]
    rows: Rows
    tokens: float
    """Sampled tokens of the mini-batch (the token-mean's denominator)."""
    sequences: float
    """Trajectories with a sampled token (the seq-mean's denominator)."""
    first: bool
    """The step's first mini-batch (still at the sampling weights)."""

    def weight(self, mask: Tensor, aggregation: str) -> float:
        """A row's share of the mini-batch's loss, for a row mask ``[rows, T]``."""
        if aggregation == "token-mean":
            return float(mask.sum()) / max(self.tokens, 1.0)
        return float((mask.sum(dim=1) > 0).sum()) / max(self.sequences, 1.0)


def mini_batches(batch: TrainBatch, policy: Policy, options: RLTrainerConfig, step: int) -> list[MiniBatch]:
    """``epochs`` seeded orders of the batch, cut into mini-batches (seeded by step: a resume draws the same)."""
    c = options
    generator = torch.Generator().manual_seed(seed_for(c.seed, "minibatch", step))
    out: list[MiniBatch] = []
    for _ in range(c.epochs):
        order = mini_batch_order(batch.group_ids, generator, by_group=c.mini_batches_by_group)
        for start in range(0, batch.size, c.mini_batch_size):
            members = order[start : start + c.mini_batch_size]
            m = batch.mask[members]
            tokens, sequences = float(m.sum()), float((m.sum(dim=1) > 0).sum())
            out.append(MiniBatch(members, policy.pack(batch, members), tokens, sequences, not out))
    return out


def update(
    batch: TrainBatch,
    policy: Policy,
    options: RLTrainerConfig,
    step: int,
    estimate: Estimator,
    update_critic: CriticUpdate | None = None,
) -> dict[str, float]:
    """The staged update of an advantage estimator; returns the step's training metrics."""
    c = options
    # 1. old log-probs: the engine's, or recomputed (then the engine/trainer gap is measured on all of them)
    diff_max = diff_mean = None
    if c.recompute_old_logprobs:
        old = policy.logprobs_of(policy.model, batch)
        diff = (old - batch.sampled_logprobs).abs() * batch.mask
        diff_max = float(diff.max()) if diff.numel() else 0.0
        diff_mean = float(diff.sum() / batch.mask.sum().clamp(min=1))
    else:
        old = batch.sampled_logprobs
    # 2. reference log-probs (the KL term's)
    ref = policy.logprobs_of(policy.reference, batch) if policy.reference is not None else None
    # 3. values and advantages
    adv = estimate(batch, old, ref, policy, c)
    started = time.perf_counter()
    steps = mini_batches(batch, policy, c, step)
    means, critic_means = Means(), Means()
    # 4. critic update (PPO; the critic and the policy share no weights, so either may go first)
    critic_norms = update_critic(batch, policy, c, steps, adv, critic_means) if update_critic is not None else []
    # 5. actor update
    grad_norms, tokens, gap = _update_actor(batch, policy, c, steps, old, adv.advantages, ref, means)
    means.merge(critic_means)
    elapsed = time.perf_counter() - started
    # 6. metrics: each rank measured its own rows; sum the weighted sums, tokens and gaps over the ranks
    parts = policy.dp.gather((means, tokens, gap, elapsed))
    total = Means()
    for part in parts:
        total.merge(part[0])
    out = total.means()
    tokens, elapsed = sum(p[1] for p in parts), max(p[3] for p in parts)
    gaps = [p[2] for p in parts if p[2][2] > 0]
    if diff_max is None and gaps:
        diff_max = max(g[0] for g in gaps)
        diff_mean = sum(g[1] for g in gaps) / sum(g[2] for g in gaps)
    out["logprob_diff_max"] = diff_max or 0.0
    out["logprob_diff_mean"] = diff_mean or 0.0
    out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
    out["grad_norm_max"] = max(grad_norms, default=0.0)
    if critic_norms:
        out["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
    out["optimizer_steps"] = float(len(grad_norms))
    out["tokens_per_s"] = tokens / elapsed if elapsed > 0 else 0.0
    out["tokens"] = float(tokens)
    out["sampled_tokens"] = float(batch.mask.sum())
    sampled_adv = adv.advantages[batch.mask != 0]
    out["advantage_mean"] = float(sampled_adv.mean()) if sampled_adv.numel() else 0.0
    out["advantage_std"] = float(sampled_adv.std()) if sampled_adv.numel() > 1 else 0.0
    return out


def _update_actor(
    batch: TrainBatch,
    policy: Policy,
    c: RLTrainerConfig,
    steps: list[MiniBatch],
    old: Tensor,
    advantages: Tensor,
    ref: Tensor | None,
    means: Means,
) -> tuple[list[float], int, tuple[float, float, float]]:
    """One optimiser step per mini-batch; (grad norms, tokens forwarded, (max, sum, count) of the gap
    between the engine's and the trainer's log-probs on the first mini-batch, before any update)."""
    measure = not c.recompute_old_logprobs
    grad_norms: list[float] = []
    tokens = 0
    gaps: list[Tensor] = []
    gap_count = 0.0
    for mb in steps:
        mine = policy.my_rows(mb.rows)
        for r, entry in enumerate(mine):
            last = r == len(mine) - 1
            if entry is None:  # this rank has fewer rows than another
                policy.idle_backward(last)
                continue
            row, idx = entry
            fwd = policy.forward(policy.model, row, with_entropy=True)
            width = max(batch.lengths[b] for b in idx)
            lp = pad_sequence(fwd.logprobs, batch_first=True)[:, :width]
            ent = pad_sequence(fwd.entropy or [], batch_first=True)[:, :width]
            m = batch.mask[idx, :width].to(lp.device)
            row_tokens = float(m.sum())
            pg, stats = policy_loss(
                lp,
                old[idx, :width].to(lp.device),
                advantages[idx, :width].to(lp.device),
                m,
                clip_low=c.clip_low,
                clip_high=c.clip_high,
                aggregation=c.loss_aggregation,
                dual_clip=c.dual_clip,
            )
            loss = pg
            entropy = aggregate_loss(ent, m, c.loss_aggregation)
            if c.entropy_coef:
                loss = loss - c.entropy_coef * entropy
            if ref is not None:
                kl = kl_loss(lp, ref[idx, :width].to(lp.device), m, c.kl_type, c.loss_aggregation)
                if c.kl_as == "loss":
                    loss = loss + c.kl_coef * kl
                means.add("kl", float(kl.detach()), row_tokens)
            # DeepSpeed averages the ranks' gradients: x world makes it their sum, the full mini-batch's
            policy.engine.backward(loss * (mb.weight(m, c.loss_aggregation) * policy.dp.world_size), last)
            tokens += row.num_tokens
            if measure and mb.first:
                gaps.append(((lp.detach().cpu() - batch.sampled_logprobs[idx, :width]).abs() * m.cpu()).flatten())
                gap_count += row_tokens
            means.add("policy_loss", float(pg.detach()), row_tokens)
            means.add("entropy", float(entropy.detach()), row_tokens)
            for name, value in stats.as_dict().items():
                means.add(name, value, row_tokens)
        grad_norms.append(policy.engine.step())
    d = torch.cat(gaps) if gaps else torch.zeros(0)
    return grad_norms, tokens, (float(d.max()) if d.numel() else 0.0, float(d.sum()), gap_count)
