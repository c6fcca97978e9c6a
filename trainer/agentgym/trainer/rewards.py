"""Rewards of trajectories: the outcome reward and the per-turn rewards, in one normalised unit.

Outcome reward (``outcome_reward``)
    ``"score"`` (default): the environment's final score normalised to [0, 1] and clipped there:
    ``clip(final_score / scale, 0, 1)`` with ``scale`` 100 for SciWorld (ScienceWorld scores
    0-100) and 1 for BabyAI (minigrid's ``1 - 0.9 * steps / max_steps``), TextCraft, Deep Search
    and WebArena (0/1). ``"success"``: 1 for a successful episode, else 0. ``"none"``: 0 (use with
    per-turn rewards only).
Per-turn rewards (``turn_reward_coef``)
    ``Turn.reward`` (the environment's step reward plus any rollout-side shaping penalties) divided
    by the same ``scale``, times ``turn_reward_coef``. DEFAULT 0: the environments' step rewards
    already add up to the episode score (TextCraft pays 1 on the crafting step, BabyAI its reward on
    the success step, SciWorld the score increments), so adding them to the outcome reward would
    count the result twice. Set it (e.g. with ``outcome_reward="none"`` for dense credit, or to
    bring in shaping penalties) when that is what you want.
Invalid-action penalty (``invalid_action_penalty``)
    ``- invalid_action_penalty`` (normalised units) on every turn whose action did not parse or that
    the environment rejected (``Turn.invalid_action``), independent of ``turn_reward_coef``. DEFAULT 0.
    With outcome rewards alone, credit is per trajectory: the well-formed later turns of a failed
    episode are pushed down with it, and a small policy can unlearn its output format that way;
    the penalty ranks failed episodes by how many turns they wasted on malformed actions.

Where rewards go
    Token-level estimators (PPO-GAE, REINFORCE++): each turn's reward on the LAST SAMPLED token of
    that turn's action and the outcome reward on the last sampled token of the trajectory, via
    :func:`agentgym.trainer.advantages.place_turn_rewards` (turn ``k`` ends at ``Turn.action_end``).
    Outcome estimators (GRPO, RLOO): one score per trajectory,
    ``outcome + turn_reward_coef * sum_k turn_reward_k / scale``, compared within its ``group_id``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from agentgym.environments import ENVIRONMENTS
from agentgym.proto import rl_pb2
from agentgym.trainer.advantages import place_turn_rewards

OutcomeReward = Literal["score", "success", "none"]

# Environment score unit -> 1: final_score / scale is in [0, 1] (from the environment cards).
DEFAULT_SCORE_SCALES: dict[str, float] = {name: card.score_scale for name, card in ENVIRONMENTS.items()}

__all__ = [
    "DEFAULT_SCORE_SCALES",
    "OutcomeReward",
    "RewardConfig",
    "outcome_reward",
    "score_scale",
    "token_rewards",
    "trajectory_scores",
    "turn_states",
    "turn_validity",
    "uniform_outcome_groups",
]


class RewardConfig:
    """How trajectories are turned into rewards (see the module docstring)."""

    def __init__(
        self,
        outcome: OutcomeReward = "score",
        turn_reward_coef: float = 0.0,
        score_scales: Mapping[str, float] | None = None,
        invalid_action_penalty: float = 0.0,
    ) -> None:
        if outcome not in ("score", "success", "none"):
            raise ValueError(f"outcome reward must be score, success or none, got {outcome!r}")
        if invalid_action_penalty < 0:
            raise ValueError(f"invalid_action_penalty must be >= 0, got {invalid_action_penalty}")
        self.outcome: OutcomeReward = outcome
        self.turn_reward_coef = float(turn_reward_coef)
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.score_scales = {**DEFAULT_SCORE_SCALES, **dict(score_scales or {})}
        for name, scale in self.score_scales.items():
            if not scale > 0:
                raise ValueError(f"score scale of {name!r} must be > 0, got {scale}")


def score_scale(environment: str, config: RewardConfig) -> float:
    """The unit of ``environment``'s scores (1 for unknown environments)."""
    return config.score_scales.get(environment, 1.0)


def outcome_reward(trajectory: rl_pb2.Trajectory, config: RewardConfig) -> float:
    """The outcome reward of one trajectory, in [0, 1]."""
    if config.outcome == "none":
        return 0.0
    if config.outcome == "success":
        return 1.0 if trajectory.success else 0.0
    value = trajectory.final_score / score_scale(trajectory.environment, config)
    return min(1.0, max(0.0, value))


def _credited_turns(trajectory: rl_pb2.Trajectory) -> list[tuple[rl_pb2.Turn, int, int]]:
    """(turn, action start, action end) of the turns that have sampled tokens to credit, in order.

    A turn whose action span is empty (the engine returned no token), lies past the response or
    does not end after the previous credited turn is skipped: it has no token of its own.
    """
    credited: list[tuple[rl_pb2.Turn, int, int]] = []
    previous = 0
    length = len(trajectory.response_token_ids)
    for turn in trajectory.turns:
        start, end = int(turn.action_start), int(turn.action_end)
        if end <= previous or end > length or end <= start:
            continue
        credited.append((turn, start, end))
        previous = end
    return credited


def _turn_rewards(trajectory: rl_pb2.Trajectory, config: RewardConfig) -> tuple[list[int], list[float]]:
    """(turn ends, scaled turn rewards) of the credited turns (:func:`_credited_turns`), in order."""
    ends: list[int] = []
    rewards: list[float] = []
    if config.turn_reward_coef == 0.0 and config.invalid_action_penalty == 0.0:
        return ends, rewards
    scale = score_scale(trajectory.environment, config)
    for turn, _, end in _credited_turns(trajectory):
        ends.append(end)
        rewards.append(_turn_reward(turn, scale, config))
    return ends, rewards


def _turn_reward(turn: rl_pb2.Turn, scale: float, config: RewardConfig) -> float:
    """One turn's reward in normalised units: its weighted env reward, less the invalid-action penalty."""
    penalty = config.invalid_action_penalty if turn.invalid_action else 0.0
    return config.turn_reward_coef * float(turn.reward) / scale - penalty


def trajectory_scores(trajectories: Sequence[rl_pb2.Trajectory], config: RewardConfig) -> Tensor:
    """``[B]`` scores for GRPO/RLOO: outcome reward plus the weighted turn rewards and invalid-action penalties."""
    values = []
    for trajectory in trajectories:
        _, rewards = _turn_rewards(trajectory, config)
        values.append(outcome_reward(trajectory, config) + sum(rewards))
    return torch.tensor(values, dtype=torch.float32)


def uniform_outcome_groups(
    trajectories: Sequence[rl_pb2.Trajectory], group_keys: Sequence[str], config: RewardConfig
) -> set[str]:
    """The groups whose trajectories all got the same outcome reward (all succeeded, or all failed).

    A group estimator gives such a group no outcome advantage (every sample equals its baseline):
    DAPO's "dynamic sampling" leaves them out of the batch. A group with one trajectory is uniform.
    """
    outcomes: dict[str, list[float]] = {}
    for trajectory, key in zip(trajectories, group_keys, strict=True):
        outcomes.setdefault(key, []).append(outcome_reward(trajectory, config))
    return {key for key, values in outcomes.items() if max(values) - min(values) <= 1e-6}


def token_rewards(trajectories: Sequence[rl_pb2.Trajectory], response_mask: Tensor, config: RewardConfig) -> Tensor:
    """``[B, T]`` token rewards for PPO / REINFORCE++ (turn rewards + outcome, on sampled tokens)."""
    batch, length = response_mask.shape
    if batch != len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories for a mask of {batch} rows")
    rows = []
    for b, trajectory in enumerate(trajectories):
        mask_row = response_mask[b : b + 1]
        ends, rewards = _turn_rewards(trajectory, config)
        ends = [min(e, length) for e in ends]
        rows.append(
            place_turn_rewards(
                mask_row,
                [ends],
                [rewards],
                outcome_rewards=[outcome_reward(trajectory, config)],
            )
        )
    if not rows:
        return torch.zeros(0, length)
    return torch.cat(rows, dim=0)


def turn_validity(trajectory: rl_pb2.Trajectory) -> tuple[list[tuple[int, int]], list[bool]]:
    """(``[start, end)`` response spans of the credited turns, whether each turn's action was invalid).

    The same turns as the turn rewards (:func:`_credited_turns`): one without sampled tokens of its
    own has nothing to credit.
    """
    credited = _credited_turns(trajectory)
    return [(start, end) for _, start, end in credited], [bool(turn.invalid_action) for turn, _, _ in credited]


def turn_states(
    trajectory: rl_pb2.Trajectory, config: RewardConfig
) -> tuple[list[tuple[int, int]], list[Hashable], list[float]]:
    """(``[start, end)`` spans, anchor-state keys, rewards) of the credited turns, for step-level groups.

    A turn's state is what the environment has said since its state last changed: the observation
    that followed the last valid action, then the replies to any invalid actions since (an invalid
    action changes nothing, and its reply, e.g. "No action found", says nothing about where the agent
    is: keyed alone, it would merge different states). The key is those observation tokens (each in
    its chat framing), as a tuple; the first turn acts on the prompt, the same for every sample of a
    group, and its key is ``()`` (plus the replies to any invalid first actions). Equal observations
    tokenise alike, so equal keys are equal states.

    Rewards are those :func:`trajectory_scores` adds up: each turn's weighted reward and invalid-action
    penalty, and the outcome reward on the last credited turn.
    """
    tokens = trajectory.response_token_ids
    spans: list[tuple[int, int]] = []
    states: list[Hashable] = []
    rewards: list[float] = []
    scale = score_scale(trajectory.environment, config)
    since_last_change: list[int] = []
    for turn, start, end in _credited_turns(trajectory):
        spans.append((start, end))
        states.append(tuple(since_last_change))
        reply = list(tokens[end : max(end, min(int(turn.observation_end), len(tokens)))])
        since_last_change = since_last_change + reply if turn.invalid_action else reply
        rewards.append(_turn_reward(turn, scale, config))
    if rewards:
        rewards[-1] += outcome_reward(trajectory, config)
    return spans, states, rewards
