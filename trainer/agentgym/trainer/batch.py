"""From protobuf Trajectories to a typed training batch, once per step.

A step's trajectories go through :func:`select` (dedup, malformed, failed, uniform groups: counted)
and then :meth:`TrainBatch.build`: token sequences, the ``[B, T]`` loss mask and sampled log-probs,
the group of every trajectory (:func:`group_key`, computed here and nowhere else), and, the first
time an estimator asks, the outcome scores, token rewards and turn spans. Supervised examples
(:class:`SFTExample`) become the same batch through :func:`example_batch`.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from agentgym.proto import rl_pb2
from agentgym.trainer.rewards import (
    RewardConfig,
    token_rewards,
    trajectory_scores,
    turn_states,
    turn_validity,
    uniform_outcome_groups,
)

log = logging.getLogger(__name__)

__all__ = [
    "DPOPair",
    "SFTExample",
    "Selection",
    "TrainBatch",
    "example_batch",
    "group_key",
    "mini_batch_order",
    "seed_for",
    "select",
    "shuffled_chunks",
    "trainable",
    "unseen",
    "validate",
]


@dataclass(frozen=True)
class SFTExample:
    """A supervised sequence in rollout layout: ``prompt_ids | response_ids``, loss where ``loss_mask`` is 1."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    environment: str = ""
    task_id: str = ""

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.loss_mask):
            raise ValueError("loss_mask must align with response_ids")
        if not self.prompt_ids:
            raise ValueError("an SFT example needs a prompt")

    @classmethod
    def of(cls, t: rl_pb2.Trajectory, *, with_task: bool = True) -> SFTExample:
        """The sampled tokens of a trajectory as an example (``with_task``: keep its environment and task)."""
        prompt, response, mask = list(t.prompt_token_ids), list(t.response_token_ids), list(t.loss_mask)
        return cls(prompt, response, mask, t.environment, t.task_id) if with_task else cls(prompt, response, mask)


@dataclass(frozen=True)
class DPOPair:
    """Two trajectories of the same task: ``chosen`` scored higher than ``rejected``."""

    chosen: SFTExample
    rejected: SFTExample


def validate(trajectory: rl_pb2.Trajectory) -> str | None:
    """Why ``trajectory`` cannot be trained on (token, mask and log-prob lengths disagree, ...), or None."""
    n = len(trajectory.response_token_ids)
    if not trajectory.prompt_token_ids:
        return "no prompt tokens"
    if len(trajectory.loss_mask) != n:
        return f"loss_mask has {len(trajectory.loss_mask)} entries for {n} response tokens"
    if len(trajectory.sampled_logprobs) != n:
        return f"sampled_logprobs has {len(trajectory.sampled_logprobs)} entries for {n} response tokens"
    if any(m not in (0, 1) for m in trajectory.loss_mask):
        return "loss_mask must be 0/1"
    if any(not math.isfinite(lp) for lp in trajectory.sampled_logprobs):
        return "non-finite sampled logprob"
    return None


def trainable(trajectory: rl_pb2.Trajectory) -> bool:
    """Well-formed, not failed, and with a sampled token: what rejection sampling and DPO pairs draw from."""
    return (
        trajectory.termination != rl_pb2.TERMINATION_ERROR
        and validate(trajectory) is None
        and any(trajectory.loss_mask)
    )


def group_key(trajectory: rl_pb2.Trajectory) -> str:
    """The group a trajectory's advantage is computed in: its ``group_id``, else its step and task."""
    return trajectory.group_id or f"{trajectory.step}/{trajectory.task_id}"


def seed_for(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (e.g. ``(seed, "minibatch", step)``): a resumed run draws the same."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def mini_batch_order(group_ids: Sequence[str], generator: torch.Generator, *, by_group: bool = True) -> list[int]:
    """A seeded random order of the batch indices; consecutive slices of it are the mini-batches.

    ``by_group``: the groups in random order, each group's indices together (in random order): a
    mini-batch of ``k * group_size`` holds ``k`` whole groups, and packing forwards each group's
    shared prompt once for all its samples in the mini-batch instead of once per group member it
    happens to draw. Otherwise a plain permutation.
    """
    order = torch.randperm(len(group_ids), generator=generator).tolist()
    if not by_group:
        return order
    groups: dict[str, list[int]] = {}
    for i in order:  # first appearance in the permutation orders the groups
        groups.setdefault(group_ids[i], []).append(i)
    return [i for members in groups.values() for i in members]


def shuffled_chunks(count: int, size: int, epochs: int, seed: int) -> list[list[int]]:
    """``epochs`` seeded shuffles of ``range(count)``, each cut into chunks of ``size``: one optimiser step each."""
    generator = torch.Generator().manual_seed(seed)
    chunks = []
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator).tolist()
        chunks += [order[start : start + size] for start in range(0, count, size)]
    return chunks


@dataclass
class Selection:
    """What :func:`select` kept of a step's trajectories, and the counts of what it dropped."""

    fresh: list[rl_pb2.Trajectory]
    """Not seen before: remembered as seen once the step is done."""
    valid: list[rl_pb2.Trajectory]
    """Fresh and well-formed: the rollout statistics and staleness are over these."""
    used: list[rl_pb2.Trajectory]
    """What the loss is computed on."""
    group_ids: list[str]
    """:func:`group_key` of each of ``used``."""
    counts: dict[str, int] = field(default_factory=dict)


def unseen(trajectories: Sequence[rl_pb2.Trajectory], seen: Container[str]) -> list[rl_pb2.Trajectory]:
    """The trajectories whose ids are not in ``seen`` nor earlier in the list (id-less ones are kept)."""
    fresh: list[rl_pb2.Trajectory] = []
    batch_ids: set[str] = set()
    for t in trajectories:
        tid = t.trajectory_id
        if tid and (tid in seen or tid in batch_ids):
            continue
        if tid:
            batch_ids.add(tid)
        fresh.append(t)
    return fresh


def select(
    trajectories: Sequence[rl_pb2.Trajectory],
    seen: Container[str],
    rewards: RewardConfig,
    *,
    train_on_failed: bool,
    drop_uniform_groups: bool,
) -> Selection:
    """Drop duplicates (of ``seen`` or earlier in the list) and malformed trajectories; leave failed ones,
    those without a sampled token and (``drop_uniform_groups``) same-outcome groups out of the loss."""
    fresh = unseen(trajectories, seen)
    valid: list[rl_pb2.Trajectory] = []
    for t in fresh:
        problem = validate(t)
        if problem is None:
            valid.append(t)
        else:
            log.warning("dropping malformed trajectory %s: %s", t.trajectory_id, problem)
    failed = sum(t.termination == rl_pb2.TERMINATION_ERROR for t in valid)
    used = [t for t in valid if (train_on_failed or t.termination != rl_pb2.TERMINATION_ERROR) and any(t.loss_mask)]
    keys = [group_key(t) for t in used]
    uniform: set[str] = set()
    if drop_uniform_groups:
        uniform = uniform_outcome_groups(used, keys, rewards)
        used, keys = (
            [t for t, k in zip(used, keys, strict=True) if k not in uniform],
            [k for k in keys if k not in uniform],
        )
    counts = {
        "received": len(trajectories),
        "duplicates": len(trajectories) - len(fresh),
        "malformed": len(fresh) - len(valid),
        "failed": failed,
        "uniform_groups": len(uniform),
        "used": len(used),
    }
    return Selection(fresh, valid, used, keys, counts)


@dataclass
class TrainBatch:
    """The step's trajectories as tensors; ``B`` trajectories, ``T`` the longest response."""

    trajectories: list[rl_pb2.Trajectory]
    rewards: RewardConfig
    sequences: list[list[int]]
    """``prompt | response`` token ids."""
    starts: list[int]
    """Where each response starts in its sequence (the prompt length)."""
    lengths: list[int]
    """Response lengths."""
    mask: Tensor
    """``[B, T]`` float: 1 on the sampled tokens the loss is computed on."""
    sampled_logprobs: Tensor
    """``[B, T]``: the engine's log-probs of the sampled tokens (0 off the mask)."""
    group_ids: list[str]
    """:func:`group_key` of every trajectory."""

    @classmethod
    def build(
        cls,
        trajectories: Sequence[rl_pb2.Trajectory],
        rewards: RewardConfig | None = None,
        group_ids: Sequence[str] | None = None,
    ) -> TrainBatch:
        """The batch of ``trajectories``; ``group_ids``: their :func:`group_key` when already known."""
        trajectories = list(trajectories)
        lengths = [len(t.response_token_ids) for t in trajectories]
        width = max(lengths, default=0)
        mask = torch.zeros(len(trajectories), width)
        sampled = torch.zeros(len(trajectories), width)
        for b, t in enumerate(trajectories):
            if n := lengths[b]:
                mask[b, :n] = torch.tensor(list(t.loss_mask), dtype=torch.float32)
                sampled[b, :n] = torch.tensor(list(t.sampled_logprobs), dtype=torch.float32)
        return cls(
            trajectories=trajectories,
            rewards=rewards if rewards is not None else RewardConfig(),
            sequences=[list(t.prompt_token_ids) + list(t.response_token_ids) for t in trajectories],
            starts=[len(t.prompt_token_ids) for t in trajectories],
            lengths=lengths,
            mask=mask,
            sampled_logprobs=sampled * mask,
            group_ids=list(group_ids) if group_ids is not None else [group_key(t) for t in trajectories],
        )

    @property
    def size(self) -> int:
        return len(self.trajectories)

    # Computed on first use: each estimator needs only some of them.
    @cached_property
    def scores(self) -> Tensor:
        """``[B]`` one score per trajectory (outcome + turn rewards), for the group estimators."""
        return trajectory_scores(self.trajectories, self.rewards)

    @cached_property
    def token_rewards(self) -> Tensor:
        """``[B, T]`` rewards on sampled tokens, for the token-level estimators."""
        return token_rewards(self.trajectories, self.mask, self.rewards)

    @cached_property
    def turn_validity(self) -> tuple[list[list[tuple[int, int]]], list[list[bool]]]:
        """(turn spans, whether each turn's action was invalid) per trajectory."""
        pairs = [turn_validity(t) for t in self.trajectories]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    @cached_property
    def turn_states(self) -> tuple[list[list[tuple[int, int]]], list[list[Hashable]], list[list[float]]]:
        """(turn spans, anchor-state keys, turn rewards) per trajectory, for step-level groups."""
        triples = [turn_states(t, self.rewards) for t in self.trajectories]
        return [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]

    @property
    def success(self) -> list[bool]:
        return [t.success for t in self.trajectories]


def example_batch(examples: Sequence[SFTExample]) -> TrainBatch:
    """Supervised examples in the layout of a training batch (no sampled log-probs)."""
    trajectories = [
        rl_pb2.Trajectory(
            prompt_token_ids=e.prompt_ids,
            response_token_ids=e.response_ids,
            loss_mask=e.loss_mask,
            sampled_logprobs=[0.0] * len(e.response_ids),
            environment=e.environment,
            task_id=e.task_id,
        )
        for e in examples
    ]
    return TrainBatch.build(trajectories)
