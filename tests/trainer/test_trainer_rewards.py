"""Reward conventions: outcome normalisation, per-turn placement, group scores, rollout metrics."""

from __future__ import annotations

import pytest
import torch

from agentgym.proto import rl_pb2
from agentgym.trainer.metrics import flatten_metrics, rollout_metrics
from agentgym.trainer.rewards import (
    RewardConfig,
    outcome_reward,
    token_rewards,
    trajectory_scores,
    turn_states,
    turn_validity,
    uniform_outcome_groups,
)


def traj(env: str, score: float, success: bool, **kw: object) -> rl_pb2.Trajectory:
    return rl_pb2.Trajectory(environment=env, final_score=score, success=success, **kw)  # type: ignore[arg-type]


def test_outcome_reward_modes() -> None:
    score = RewardConfig()
    assert outcome_reward(traj("sciworld", 57.0, False), score) == pytest.approx(0.57)
    assert outcome_reward(traj("sciworld", 100.0, True), score) == 1.0
    assert outcome_reward(traj("babyai", 0.82, True), score) == pytest.approx(0.82)
    assert outcome_reward(traj("textcraft", 1.0, True), score) == 1.0
    assert outcome_reward(traj("babyai", -0.5, False), score) == 0.0  # clipped
    assert outcome_reward(traj("babyai", 3.0, False), score) == 1.0
    success = RewardConfig("success")
    assert outcome_reward(traj("sciworld", 57.0, False), success) == 0.0
    assert outcome_reward(traj("babyai", 0.82, True), success) == 1.0
    assert outcome_reward(traj("babyai", 0.82, True), RewardConfig("none")) == 0.0
    assert outcome_reward(traj("babyai", 5.0, True), RewardConfig(score_scales={"babyai": 10.0})) == 0.5
    with pytest.raises(ValueError):
        RewardConfig("bogus")  # type: ignore[arg-type]


def _two_turns(env: str = "sciworld") -> rl_pb2.Trajectory:
    # response: [a a | o o o | a a a]  turns: [0,2) obs to 5, [5,8)
    return rl_pb2.Trajectory(
        environment=env,
        response_token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        loss_mask=[1, 1, 0, 0, 0, 1, 1, 1],
        turns=[
            rl_pb2.Turn(action_start=0, action_end=2, observation_end=5, reward=10.0),
            rl_pb2.Turn(action_start=5, action_end=8, observation_end=8, reward=30.0),
        ],
        final_score=40.0,
        success=False,
    )


def test_token_rewards_default_outcome_only_on_last_sampled_token() -> None:
    t = _two_turns()
    mask = torch.tensor([list(t.loss_mask)], dtype=torch.float32)
    rewards = token_rewards([t], mask, RewardConfig())
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 0, 0, pytest.approx(0.4)]]


def test_token_rewards_with_turn_rewards() -> None:
    t = _two_turns()
    mask = torch.tensor([list(t.loss_mask)], dtype=torch.float32)
    rewards = token_rewards([t], mask, RewardConfig("none", turn_reward_coef=1.0))
    # turn rewards / 100 on the last sampled token of each turn: positions 1 and 7
    torch.testing.assert_close(rewards, torch.tensor([[0, 0.1, 0, 0, 0, 0, 0, 0.3]]))
    both = token_rewards([t], mask, RewardConfig("score", turn_reward_coef=0.5))
    torch.testing.assert_close(both, torch.tensor([[0, 0.05, 0, 0, 0, 0, 0, 0.15 + 0.4]]))
    scores = trajectory_scores([t], RewardConfig("score", turn_reward_coef=0.5))
    torch.testing.assert_close(scores, torch.tensor([0.4 + 0.05 + 0.15]))


def test_rollout_metrics_per_environment() -> None:
    trajectories = [
        rl_pb2.Trajectory(
            environment="babyai",
            final_score=0.9,
            success=True,
            turns_used=2,
            termination=rl_pb2.TERMINATION_DONE,
            turns=[rl_pb2.Turn(invalid_action=True), rl_pb2.Turn()],
        ),
        rl_pb2.Trajectory(
            environment="babyai",
            final_score=0.0,
            success=False,
            turns_used=3,
            horizon=3,
            termination=rl_pb2.TERMINATION_HORIZON,
            turns=[rl_pb2.Turn(), rl_pb2.Turn(repeated_action=True), rl_pb2.Turn()],
        ),
        rl_pb2.Trajectory(
            environment="sciworld",
            final_score=50.0,
            termination=rl_pb2.TERMINATION_ERROR,
            turns_used=1,
            turns=[rl_pb2.Turn()],
        ),
    ]
    stats = rollout_metrics(trajectories, RewardConfig())
    baby = stats["babyai"]
    assert baby["reward_mean"] == pytest.approx(0.45)
    assert baby["reward_std"] == pytest.approx(0.45)
    assert baby["success_rate"] == 0.5
    assert baby["turns_mean"] == 2.5
    assert (baby["horizon_max"], stats["sciworld"]["horizon_max"], stats["all"]["horizon_max"]) == (3, 0, 3)
    assert baby["truncation_rate"] == 0.5
    assert baby["failed_rate"] == 0.0
    assert baby["invalid_action_rate"] == pytest.approx(1 / 5)
    assert baby["repeated_action_rate"] == pytest.approx(1 / 5)
    assert stats["sciworld"]["failed_rate"] == 1.0
    assert stats["sciworld"]["reward_mean"] == 0.5
    assert stats["all"]["trajectories"] == 3
    assert stats["all"]["failed_rate"] == pytest.approx(1 / 3)
    flat = flatten_metrics({"env": stats, "kl": 0.1})
    assert flat["babyai/success_rate"] == 0.5 and flat["kl"] == 0.1


def test_invalid_action_penalty_per_malformed_turn() -> None:
    t = _two_turns("babyai")
    t.final_score, t.success = 0.8, True
    t.turns[0].invalid_action = True  # the first action was rejected, the second one succeeded
    mask = torch.tensor([list(t.loss_mask)], dtype=torch.float32)
    config = RewardConfig(invalid_action_penalty=0.1)
    # Token level: -0.1 on the last sampled token of the invalid turn (position 1), outcome 0.8 at the end;
    # the turns' own rewards stay out (turn_reward_coef 0).
    assert token_rewards([t], mask, config).tolist() == [[0, pytest.approx(-0.1), 0, 0, 0, 0, 0, pytest.approx(0.8)]]
    # Group scores: 0.8 - 0.1; a clean trajectory keeps its outcome; two invalid turns cost 0.2.
    clean = _two_turns("babyai")
    clean.final_score = 0.8
    both = _two_turns("babyai")
    both.final_score = 0.0
    for turn in both.turns:
        turn.invalid_action = True
    assert trajectory_scores([t, clean, both], config).tolist() == [
        pytest.approx(0.7),
        pytest.approx(0.8),
        pytest.approx(-0.2),
    ]
    # With turn rewards on as well, both add up: 0.8 + (0.8 * 10 + 0.8 * 30) - 0.1.
    both_terms = RewardConfig(turn_reward_coef=0.8, invalid_action_penalty=0.1)
    assert trajectory_scores([t], both_terms).tolist() == [pytest.approx(0.8 + 32.0 - 0.1)]
    with pytest.raises(ValueError, match="invalid_action_penalty"):
        RewardConfig(invalid_action_penalty=-1.0)


def test_turn_validity_spans_and_flags() -> None:
    t = _two_turns("babyai")
    t.turns[0].invalid_action = True
    assert turn_validity(t) == ([(0, 2), (5, 8)], [True, False])
    # A turn without sampled tokens (the engine returned none) or past the response has nothing to credit.
    t.turns.append(rl_pb2.Turn(action_start=8, action_end=8, observation_end=8, invalid_action=True))
    t.turns.append(rl_pb2.Turn(action_start=8, action_end=12, observation_end=12))
    assert turn_validity(t) == ([(0, 2), (5, 8)], [True, False])
    # Nor one that does not end after the turn before it; the turn rewards skip the same turns.
    t.turns.append(rl_pb2.Turn(action_start=6, action_end=7, observation_end=8, invalid_action=True))
    assert turn_validity(t) == ([(0, 2), (5, 8)], [True, False])
    penalties = RewardConfig(invalid_action_penalty=0.1)
    row = token_rewards([t], torch.tensor([list(t.loss_mask)], dtype=torch.float32), penalties)[0].tolist()
    # -0.1 for the first (invalid) turn only; the outcome (score 40, clipped to 1 for babyai) on the last token.
    assert row == [0.0, pytest.approx(-0.1), 0.0, 0.0, 0.0, 0.0, 0.0, pytest.approx(1.0)]


def test_turn_states_keys_and_rewards() -> None:
    t = _two_turns("babyai")
    spans, states, rewards = turn_states(t, RewardConfig(invalid_action_penalty=0.1))
    # The first turn acts on the prompt (key ()); the second on the observation tokens 3, 4, 5.
    assert spans == [(0, 2), (5, 8)] and states == [(), (3, 4, 5)]
    assert rewards == [0.0, pytest.approx(1.0)]  # the outcome (score 40 clipped to 1 for babyai) on the last
    # An invalid action changes nothing: the next turn's state is the last valid observation plus the
    # reply to the invalid action (here the first turn was invalid: () plus its reply).
    t.turns[0].invalid_action = True
    _, states, rewards = turn_states(t, RewardConfig(invalid_action_penalty=0.1))
    assert states == [(), (3, 4, 5)]
    assert rewards == [pytest.approx(-0.1), pytest.approx(1.0)]  # -0.1 for the invalid first turn
    # They add up to the GRPO score of the trajectory.
    assert sum(rewards) == pytest.approx(float(trajectory_scores([t], RewardConfig(invalid_action_penalty=0.1))[0]))
    # Turn rewards count with their weight (sciworld: /100): 0.5 * 10/100, 0.5 * 30/100 + 0.4.
    _, _, weighted = turn_states(_two_turns(), RewardConfig(turn_reward_coef=0.5))
    assert weighted == [pytest.approx(0.05), pytest.approx(0.15 + 0.4)]
    # Turns without tokens of their own are skipped, as for the validity credit.
    t.turns.append(rl_pb2.Turn(action_start=8, action_end=8, observation_end=8))
    assert turn_states(t, RewardConfig())[0] == turn_validity(t)[0]


def test_turn_states_after_invalid_actions_keep_the_last_valid_observation() -> None:
    # response: [a | o1 o1 | a | e e | a | e | a]: valid, invalid, invalid, then the fourth turn.
    t = rl_pb2.Trajectory(
        environment="babyai",
        response_token_ids=[1, 10, 11, 2, 20, 21, 3, 30, 4],
        loss_mask=[1, 0, 0, 1, 0, 0, 1, 0, 1],
        turns=[
            rl_pb2.Turn(action_start=0, action_end=1, observation_end=3),
            rl_pb2.Turn(action_start=3, action_end=4, observation_end=6, invalid_action=True),
            rl_pb2.Turn(action_start=6, action_end=7, observation_end=8, invalid_action=True),
            rl_pb2.Turn(action_start=8, action_end=9, observation_end=9),
        ],
    )
    _, states, _ = turn_states(t, RewardConfig())
    # The sampled tokens (2, 3) never enter a key: two samples that erred differently from one state
    # and got the same replies are in the same state.
    assert states == [(), (10, 11), (10, 11, 20, 21), (10, 11, 20, 21, 30)]


def test_uniform_outcome_groups() -> None:
    trajectories = [
        traj("babyai", 1.0, True),  # a: both succeeded
        traj("babyai", 1.0, True),
        traj("babyai", 0.0, False),  # b: both failed
        traj("babyai", 0.0, False),
        traj("babyai", 1.0, True),  # c: one of each
        traj("babyai", 0.0, False),
        traj("babyai", 1.0, True),  # d: alone
        traj("sciworld", 40.0, False),  # e: same partial score
        traj("sciworld", 40.0, False),
        traj("sciworld", 40.0, False),  # f: partial scores that differ
        traj("sciworld", 70.0, False),
    ]
    keys = ["a", "a", "b", "b", "c", "c", "d", "e", "e", "f", "f"]
    assert uniform_outcome_groups(trajectories, keys, RewardConfig()) == {"a", "b", "d", "e"}
    # on success alone, f's partial scores are the same failure
    assert uniform_outcome_groups(trajectories, keys, RewardConfig("success")) == {"a", "b", "d", "e", "f"}
