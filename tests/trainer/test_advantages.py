"""Advantage estimators against hand-computed values on a small multi-turn batch.

The fixture batch (B=3, T=8); A = sampled action token, O = observation token, P = padding:

    position   0  1  2  3  4  5  6  7
    row 0      A  A  O  O  A  A  P  P      2 turns; ends with an action, then padding
    row 1      A  O  O  A  A  O  O  O      2 turns; ends with the environment's final observation
    row 2      A  A  A  O  A  O  A  P      3 turns

Last sampled token per row: 5, 4, 6 (never 7, the row's last position, which is masked).
"""

from __future__ import annotations

import math

import pytest
import torch

from agentgym.trainer.advantages import (
    check_rewards_on_sampled_tokens,
    gae_advantages,
    grpo_advantages,
    kl_penalized_rewards,
    last_sampled_index,
    masked_mean,
    masked_var,
    masked_whiten,
    place_outcome_rewards,
    place_turn_rewards,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    sampled_spans,
    scale_negative_advantages,
    step_group_advantages,
    turn_returns,
    turn_validity_advantages,
)

MASK = torch.tensor(
    [
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 1, 0],
    ]
)

# Hand-placed token rewards for turn rewards [[0.5, 0], [0, 0.25], [0.1, 0.2, 0.3]] and outcome
# rewards [1.0, 0.0, 2.0]: each turn reward on its turn's last action token, the outcome added on the
# last action token of the last turn (row 0: 0 + 1.0 at 5; row 2: 0.3 + 2.0 = 2.3 at 6).
TOKEN_REWARDS = torch.tensor(
    [
        [0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.1, 0.0, 0.2, 0.0, 2.3, 0.0],
    ]
)
TURN_REWARDS = [[0.5, 0.0], [0.0, 0.25], [0.1, 0.2, 0.3]]
OUTCOMES = [1.0, 0.0, 2.0]


def close(actual: torch.Tensor, expected: float | list[float] | list[list[float]], atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def whiten_by_hand(values: list[float], eps: float = 1e-8) -> list[float]:
    """(x - mean) / sqrt(unbiased var + eps), written out independently of the module."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + eps) for v in values]


# ---------------------------------------------------------------------------------------------
# reward placement
# ---------------------------------------------------------------------------------------------


def test_last_sampled_index_is_the_last_action_token_not_the_last_position() -> None:
    assert last_sampled_index(MASK).tolist() == [5, 4, 6]
    assert last_sampled_index(torch.zeros(2, 3)).tolist() == [-1, -1]


def test_sampled_spans_are_the_action_spans() -> None:
    assert sampled_spans(MASK) == [
        [(0, 2), (4, 6)],
        [(0, 1), (3, 5)],
        [(0, 3), (4, 5), (6, 7)],
    ]


@pytest.mark.parametrize(
    "turn_ends",
    [
        [[4, 6], [3, 8], [4, 6, 7]],  # observation ends (Turn.observation_end)
        [[2, 6], [1, 5], [3, 5, 7]],  # action ends (Turn.action_end)
        None,  # derived from the runs of sampled tokens
    ],
)
def test_place_turn_rewards_puts_each_reward_on_the_turns_last_sampled_token(
    turn_ends: list[list[int]] | None,
) -> None:
    placed = place_turn_rewards(MASK, turn_ends, TURN_REWARDS, OUTCOMES)
    close(placed, TOKEN_REWARDS.tolist())
    # nothing lands on a masked token
    assert bool((placed[MASK == 0] == 0).all())


def test_place_outcome_rewards() -> None:
    # scores on positions 5, 4, 6
    close(
        place_outcome_rewards(MASK, [1.0, -2.0, 3.0]),
        [
            [0, 0, 0, 0, 0, 1.0, 0, 0],
            [0, 0, 0, 0, -2.0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 3.0, 0],
        ],
    )


def test_place_turn_rewards_rejects_bad_input() -> None:
    # turn 1 of row 0 given as [2, 4) holds only observation tokens: its non-zero reward has no home
    with pytest.raises(ValueError, match="no sampled token"):
        place_turn_rewards(MASK[:1], [[2, 4]], [[0.0, 1.0]])
    # a zero reward there is fine (nothing is lost); turn 0 = [0, 2) puts 0.5 on position 1
    close(place_turn_rewards(MASK[:1], [[2, 4]], [[0.5, 0.0]]), [[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="increase strictly"):
        place_turn_rewards(MASK[:1], [[4, 4]], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="increase strictly"):
        place_turn_rewards(MASK[:1], [[4, 9]], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="turn rewards"):
        place_turn_rewards(MASK[:1], [[4, 6]], [[1.0]])
    with pytest.raises(ValueError, match="no sampled token"):
        place_outcome_rewards(torch.zeros(1, 4), [1.0])


def test_naive_terminal_placement_is_refused_by_token_estimators() -> None:
    # The anchor's bug: the outcome on the last token of the sequence, here row 1's final
    # observation (position 7, masked). Both token-level estimators must refuse, not drop it.
    naive = torch.zeros(3, 8)
    naive[1, 7] = 1.0
    with pytest.raises(ValueError, match="masked token"):
        check_rewards_on_sampled_tokens(naive, MASK)
    with pytest.raises(ValueError, match="masked token"):
        reinforce_plus_plus_advantages(naive, MASK, gamma=1.0)
    with pytest.raises(ValueError, match="masked token"):
        gae_advantages(naive, torch.zeros(3, 8), MASK, gamma=1.0, lam=1.0)


# ---------------------------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------------------------


def test_masked_statistics() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    # mean (1 + 2 + 3) / 3 = 2; squared deviations 1, 0, 1
    close(masked_mean(x, m), 2.0)
    close(masked_var(x, m), 1.0)  # 2 / (3 - 1)
    close(masked_var(x, m, unbiased=False), 2.0 / 3.0)
    # (x - 2) / sqrt(1 + 1e-8); the masked 100 becomes 0
    s = 1.0 / math.sqrt(1.0 + 1e-8)
    close(masked_whiten(x, m), [[-s, 0.0, s, 0.0]])
    close(masked_whiten(x, m, shift_mean=False), [[2.0 - s, 2.0, 2.0 + s, 0.0]])
    # mean along a dimension
    close(masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 1], [0, 1]]), dim=1), [2.0, 7.0])


# ---------------------------------------------------------------------------------------------
# GRPO and RLOO
# ---------------------------------------------------------------------------------------------

# Groups: a = rows 0-2 with scores [1, 0, 0]; b = rows 3-4 with [2, 4]; c = row 5 alone with [5].
SCORES = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 5.0])
GROUPS = ["a", "a", "a", "b", "b", "c"]
GROUP_MASK = torch.tensor([[1, 1, 0, 1]] * 6)


def test_grpo_with_unbiased_std_and_singleton_group() -> None:
    # group a: mean 1/3; deviations 2/3, -1/3, -1/3; sum of squares 4/9 + 1/9 + 1/9 = 2/3;
    #   unbiased var (2/3) / 2 = 1/3 -> std 1/sqrt(3) = 0.57735
    #   A = (2/3) / (0.57735 + 1e-6) = 1.1547, -0.57735, -0.57735
    #   (population std sqrt(2/9) = 0.4714 would give 1.4142: the test pins the convention)
    # group b: mean 3; deviations -1, +1; unbiased var 2 / 1 = 2 -> std sqrt(2); A = -+0.70711
    # group c: singleton -> 0
    eps = 1e-6
    sa = 1.0 / math.sqrt(3.0) + eps
    sb = math.sqrt(2.0) + eps
    per_traj = [(2 / 3) / sa, (-1 / 3) / sa, (-1 / 3) / sa, -1.0 / sb, 1.0 / sb, 0.0]
    adv = grpo_advantages(SCORES, GROUPS, GROUP_MASK)
    close(adv, [[a, a, 0.0, a] for a in per_traj])
    # the same with a LongTensor of group ids (any values)
    close(grpo_advantages(SCORES, torch.tensor([7, 7, 7, 2, 2, 9]), GROUP_MASK), adv.tolist())


def test_grpo_without_std() -> None:
    # r - group mean: a: 1 - 1/3, 0 - 1/3, 0 - 1/3; b: 2 - 3, 4 - 3; c: singleton 0
    per_traj = [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 0.0]
    adv = grpo_advantages(SCORES, GROUPS, GROUP_MASK, normalize_by_std=False)
    close(adv, [[a, a, 0.0, a] for a in per_traj])


def test_grpo_equal_scores_give_zero() -> None:
    # mean 3, deviations 0, std 0: 0 / (0 + eps) = 0
    adv = grpo_advantages(torch.tensor([3.0, 3.0]), [0, 0], torch.ones(2, 2))
    close(adv, [[0.0, 0.0], [0.0, 0.0]])


def test_rloo_leave_one_out() -> None:
    # a [1, 0, 0]: 1 - (0 + 0)/2 = 1; 0 - (1 + 0)/2 = -0.5 (twice)
    # b [2, 4]: 2 - 4 = -2; 4 - 2 = 2;  c singleton: 0
    per_traj = [1.0, -0.5, -0.5, -2.0, 2.0, 0.0]
    close(rloo_advantages(SCORES, GROUPS, GROUP_MASK), [[a, a, 0.0, a] for a in per_traj])


def test_rloo_group_of_four() -> None:
    # [1, 2, 3, 6], sum 12: 1 - 11/3 = -8/3; 2 - 10/3 = -4/3; 3 - 9/3 = 0; 6 - 6/3 = 4
    adv = rloo_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1))
    close(adv, [[-8 / 3], [-4 / 3], [0.0], [4.0]])


# ---------------------------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------------------------

# Returns with gamma = 0.5 over SAMPLED tokens only (observations skipped, not discounted):
# row 0 (sampled 0, 1, 4, 5; rewards 0.5 at 1, 1.0 at 5):
#   G5 = 1;  G4 = 0 + 0.5 * 1 = 0.5;  G1 = 0.5 + 0.5 * 0.5 = 0.75;  G0 = 0.5 * 0.75 = 0.375
#   (discounting over all positions would give G1 = 0.5 + 0.5^3 * 1 = 0.625)
# row 1 (sampled 0, 3, 4; 0.25 at 4): G4 = 0.25; G3 = 0.125; G0 = 0.0625
# row 2 (sampled 0, 1, 2, 4, 6; 0.1 at 2, 0.2 at 4, 2.3 at 6):
#   G6 = 2.3;  G4 = 0.2 + 0.5 * 2.3 = 1.35;  G2 = 0.1 + 0.5 * 1.35 = 0.775;  G1 = 0.3875;  G0 = 0.19375
RPP_RETURNS = [
    [0.375, 0.75, 0.0, 0.0, 0.5, 1.0, 0.0, 0.0],
    [0.0625, 0.0, 0.0, 0.125, 0.25, 0.0, 0.0, 0.0],
    [0.19375, 0.3875, 0.775, 0.0, 1.35, 0.0, 2.3, 0.0],
]


def test_reinforce_plus_plus_returns_discount_over_sampled_tokens_only() -> None:
    returns = reinforce_plus_plus_advantages(TOKEN_REWARDS, MASK, gamma=0.5, whiten=False)
    close(returns, RPP_RETURNS)


def test_reinforce_plus_plus_whitens_over_all_sampled_tokens_of_the_batch() -> None:
    sampled = [RPP_RETURNS[b][t] for b in range(3) for t in range(8) if MASK[b, t]]
    assert len(sampled) == 12  # 4 + 3 + 5
    white = iter(whiten_by_hand(sampled))
    expected = [[next(white) if MASK[b, t] else 0.0 for t in range(8)] for b in range(3)]
    adv = reinforce_plus_plus_advantages(TOKEN_REWARDS, MASK, gamma=0.5)
    close(adv, expected, atol=1e-5)


def test_reinforce_plus_plus_from_placed_rewards_keeps_the_terminal_reward() -> None:
    # End to end from turn rewards: the same returns as the hand-placed tensor.
    placed = place_turn_rewards(MASK, None, TURN_REWARDS, OUTCOMES)
    close(reinforce_plus_plus_advantages(placed, MASK, gamma=0.5, whiten=False), RPP_RETURNS)


def test_reinforce_plus_plus_kl_penalty_only_on_sampled_tokens() -> None:
    # mask [1, 0, 1, 0]; reward 1 on position 2; kl [0.2, 5.0, 0.4, 7.0] (5 and 7 sit on masked
    # tokens and must be ignored); kl_coef 0.5, gamma 0.9:
    #   r' = [0 - 0.1, -, 1 - 0.2, -] = [-0.1, 0, 0.8, 0]
    #   G2 = 0.8;  G0 = -0.1 + 0.9 * 0.8 = 0.62
    mask = torch.tensor([[1, 0, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    kl = torch.tensor([[0.2, 5.0, 0.4, 7.0]])
    close(kl_penalized_rewards(rewards, mask, kl, 0.5), [[-0.1, 0.0, 0.8, 0.0]])
    g = reinforce_plus_plus_advantages(rewards, mask, gamma=0.9, kl_per_token=kl, kl_coef=0.5, whiten=False)
    close(g, [[0.62, 0.0, 0.8, 0.0]])
    # whitened: mean 0.71, deviations -+0.09, unbiased var 2 * 0.09^2 / 1 = 0.0162
    w = 0.09 / math.sqrt(0.0162 + 1e-8)
    adv = reinforce_plus_plus_advantages(rewards, mask, gamma=0.9, kl_per_token=kl, kl_coef=0.5)
    close(adv, [[-w, 0.0, w, 0.0]], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------

# gamma = 0.5, lam = 0.8 (gamma * lam = 0.4). Values on masked tokens are 99: they must never be read.
GAE_MASK = MASK[:2]
GAE_REWARDS = torch.tensor(
    [
        [0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],  # turn reward 0.5 at 1, terminal 1.0 at 5
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],  # terminal 1.0 at 4
    ]
)
GAE_VALUES = torch.tensor(
    [
        [0.5, 0.25, 99.0, 99.0, 0.5, 0.25, 99.0, 99.0],
        [0.2, 99.0, 99.0, 0.4, 0.6, 99.0, 99.0, 99.0],
    ]
)
# row 0, sampled 0, 1, 4, 5:
#   t5: delta = 1 + 0.5*0 - 0.25 = 0.75                    A5 = 0.75
#   t4: delta = 0 + 0.5*0.25 - 0.5 = -0.375                A4 = -0.375 + 0.4*0.75 = -0.075
#   t1: next sampled is t4: delta = 0.5 + 0.5*0.5 - 0.25 = 0.5
#                                                           A1 = 0.5 + 0.4*(-0.075) = 0.47
#   t0: delta = 0 + 0.5*0.25 - 0.5 = -0.375                A0 = -0.375 + 0.4*0.47 = -0.187
#   returns A + V: 0.313, 0.72, 0.425, 1.0
#   (terminal reward dropped: A5 = -0.25; value 99 of the observation used: A1 = 49.75...)
# row 1, sampled 0, 3, 4:
#   t4: delta = 1 - 0.6 = 0.4                               A4 = 0.4
#   t3: delta = 0 + 0.5*0.6 - 0.4 = -0.1                    A3 = -0.1 + 0.4*0.4 = 0.06
#   t0: delta = 0 + 0.5*0.4 - 0.2 = 0                       A0 = 0 + 0.4*0.06 = 0.024
#   returns: 0.224, 0.46, 1.0
GAE_ADV = [
    [-0.187, 0.47, 0.0, 0.0, -0.075, 0.75, 0.0, 0.0],
    [0.024, 0.0, 0.0, 0.06, 0.4, 0.0, 0.0, 0.0],
]
GAE_RET = [
    [0.313, 0.72, 0.0, 0.0, 0.425, 1.0, 0.0, 0.0],
    [0.224, 0.0, 0.0, 0.46, 1.0, 0.0, 0.0, 0.0],
]


def test_gae_skips_observation_tokens_and_uses_the_terminal_reward() -> None:
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.8, whiten=False)
    close(adv, GAE_ADV)
    close(ret, GAE_RET)


def test_gae_whitened_advantages_unwhitened_returns() -> None:
    sampled = [GAE_ADV[b][t] for b in range(2) for t in range(8) if GAE_MASK[b, t]]
    white = iter(whiten_by_hand(sampled))
    expected = [[next(white) if GAE_MASK[b, t] else 0.0 for t in range(8)] for b in range(2)]
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.8)
    close(adv, expected, atol=1e-5)
    close(ret, GAE_RET)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value() -> None:
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t over sampled tokens.
    # row 0: rewards-to-go t0: 1.5, t1: 1.5, t4: 1.0, t5: 1.0; minus V 0.5, 0.25, 0.5, 0.25
    adv, ret = gae_advantages(GAE_REWARDS[:1], GAE_VALUES[:1], GAE_MASK[:1], gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[1.0, 1.25, 0.0, 0.0, 0.5, 0.75, 0.0, 0.0]])
    close(ret, [[1.5, 1.5, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]])


def test_gae_rejects_mismatched_values() -> None:
    with pytest.raises(ValueError, match="values"):
        gae_advantages(GAE_REWARDS, torch.zeros(2, 7), GAE_MASK, gamma=1.0, lam=1.0)


# ---------------------------------------------------------------------------------------------
# turn-level validity credit
# ---------------------------------------------------------------------------------------------

# The turns of MASK as [start, end) spans of their action tokens.
TURN_SPANS = [[(0, 2), (4, 6)], [(0, 1), (3, 5)], [(0, 3), (4, 5), (6, 7)]]


def test_turn_validity_advantages_by_hand() -> None:
    # Rows 0 and 1 are one group, row 2 another. Invalid turns: row 0's first; row 2's last two.
    # group a, turn values [-1, 0 | 0, 0]: mean -1/4; deviations -3/4, 1/4, 1/4, 1/4;
    #   squares 9/16 + 3/16 = 3/4; unbiased var (3/4) / 3 = 1/4 -> std 1/2
    #   A = (-3/4) / (1/2 + eps) = -1.5 on row 0's first turn; (1/4) / (1/2 + eps) = 0.5 on the others
    # group b (one trajectory, three turns) [0, -1, -1]: mean -2/3; deviations 2/3, -1/3, -1/3;
    #   unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3 -> std 0.57735; A = 1.1547, -0.57735, -0.57735
    eps = 1e-6
    sa, sb = 0.5 + eps, 1.0 / math.sqrt(3.0) + eps
    bad_a, ok_a = -0.75 / sa, 0.25 / sa
    ok_b, bad_b = (2 / 3) / sb, (-1 / 3) / sb
    invalid = [[True, False], [False, False], [False, True, True]]
    adv = turn_validity_advantages(TURN_SPANS, invalid, ["a", "a", "b"], MASK)
    close(
        adv,
        [
            [bad_a, bad_a, 0.0, 0.0, ok_a, ok_a, 0.0, 0.0],
            [ok_a, 0.0, 0.0, ok_a, ok_a, 0.0, 0.0, 0.0],
            [ok_b, ok_b, ok_b, 0.0, bad_b, 0.0, bad_b, 0.0],
        ],
        atol=1e-5,
    )
    # Without the std (Dr. GRPO style): v - mean, so -3/4 and 1/4 in group a; 2/3 and -1/3 in group b.
    centred = turn_validity_advantages(TURN_SPANS, invalid, ["a", "a", "b"], MASK, normalize_by_std=False)
    close(
        centred,
        [
            [-0.75, -0.75, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0],
            [0.25, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0, 0.0],
            [2 / 3, 2 / 3, 2 / 3, 0.0, -1 / 3, 0.0, -1 / 3, 0.0],
        ],
    )
    # One value per turn, and they sum to zero within a group: credit moves between turns.
    assert abs(float(adv[0, 0] + adv[0, 4] + adv[1, 0] + adv[1, 3])) < 1e-5
    assert abs(float(adv[2, 0] + adv[2, 4] + adv[2, 6])) < 1e-5


def test_turn_validity_advantages_zero_when_nothing_to_compare() -> None:
    all_valid = [[False, False], [False, False], [False, False, False]]
    close(turn_validity_advantages(TURN_SPANS, all_valid, [0, 0, 0], MASK), torch.zeros(3, 8).tolist())
    all_invalid = [[True, True], [True, True], [True, True, True]]
    close(turn_validity_advantages(TURN_SPANS, all_invalid, [0, 1, 2], MASK), torch.zeros(3, 8).tolist())
    # One turn alone in its group has no other turn to be compared with.
    single = turn_validity_advantages([[(0, 2)]], [[True]], ["g"], torch.ones(1, 2))
    close(single, [[0.0, 0.0]])


def test_turn_validity_advantages_only_in_groups_with_a_success() -> None:
    # The by-hand case above, with success flags: in group a row 1 succeeded, so its credit stands
    # (-1.5 / 0.5 on the same turns); group b's only trajectory failed, so it gets nothing.
    eps = 1e-6
    sa = 0.5 + eps
    bad_a, ok_a = -0.75 / sa, 0.25 / sa
    invalid = [[True, False], [False, False], [False, True, True]]
    adv = turn_validity_advantages(TURN_SPANS, invalid, ["a", "a", "b"], MASK, success=[False, True, False])
    close(
        adv,
        [
            [bad_a, bad_a, 0.0, 0.0, ok_a, ok_a, 0.0, 0.0],
            [ok_a, 0.0, 0.0, ok_a, ok_a, 0.0, 0.0, 0.0],
            [0.0] * 8,
        ],
        atol=1e-5,
    )
    # No success anywhere: no credit anywhere; every group with one: the ungated values.
    nothing = turn_validity_advantages(TURN_SPANS, invalid, ["a", "a", "b"], MASK, success=[False, False, False])
    close(nothing, torch.zeros(3, 8).tolist())
    ungated = turn_validity_advantages(TURN_SPANS, invalid, ["a", "a", "b"], MASK)
    close(turn_validity_advantages(TURN_SPANS, invalid, ["a", "a", "b"], MASK, success=[True, False, True]), ungated)
    with pytest.raises(ValueError, match="success flags for 2 rows"):
        turn_validity_advantages(TURN_SPANS, invalid, ["a", "a", "b"], MASK, success=[True, False])


def test_turn_validity_advantages_stay_on_sampled_tokens_and_check_input() -> None:
    # A span that covers an observation token (row 1's turn 0 as [0, 3)) is still masked there.
    spans = [[(0, 2), (4, 6)], [(0, 3), (3, 5)], [(0, 3), (4, 5), (6, 7)]]
    adv = turn_validity_advantages(spans, [[True, False], [False, False], [False, False, False]], [0, 0, 0], MASK)
    assert float((adv * (1 - MASK)).abs().sum()) == 0.0
    with pytest.raises(ValueError, match="turn spans"):
        turn_validity_advantages(TURN_SPANS[:2], [[True, False], [False, False]], [0, 0], MASK)
    with pytest.raises(ValueError, match="validity flags"):
        turn_validity_advantages(TURN_SPANS, [[True], [False, False], [False, False, False]], [0, 0, 0], MASK)


# ---------------------------------------------------------------------------------------------
# step-level groups over anchor states (GiGPO)
# ---------------------------------------------------------------------------------------------


def test_turn_returns_by_hand() -> None:
    # Outcome 1 on the last of three turns, gamma 0.5: R = [0.25, 0.5, 1].
    assert turn_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    # R2 = 2; R1 = -0.1 + 0.9 * 2 = 1.7; R0 = 1 + 0.9 * 1.7 = 2.53
    assert turn_returns([1.0, -0.1, 2.0], 0.9) == pytest.approx([2.53, 1.7, 2.0])
    assert turn_returns([0.0, 1.0], 1.0) == [1.0, 1.0] and turn_returns([], 0.9) == []
    with pytest.raises(ValueError, match="gamma"):
        turn_returns([1.0], 1.5)


# Rows 0 and 1 are group a, row 2 group b. Row 0 succeeds at its second turn; row 1 turns back to
# the start state and fails; row 2 leaves the start, comes back to it and succeeds at its third turn.
STEP_STATES = [["s0", "x"], ["s0", "s0"], ["s0", "y", "s0"]]
STEP_REWARDS = [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0, 1.0]]


def test_step_group_advantages_by_hand() -> None:
    # gamma 0.5 -> returns: row 0 [0.5, 1]; row 1 [0, 0]; row 2 [0.25, 0.5, 1].
    # (a, s0): row 0 turn 0 (0.5), row 1 turns 0 and 1 (0, 0): mean 1/6; deviations 1/3, -1/6, -1/6;
    #   unbiased var (1/9 + 1/36 + 1/36) / 2 = 1/12 -> std 0.288675; A = 1.1547, -0.57735, -0.57735
    # (a, x): row 0 turn 1 alone -> 0.   (b, y): row 2 turn 1 alone -> 0.
    # (b, s0): row 2 turns 0 and 2 (0.25, 1): mean 0.625, deviations -+0.375, std 0.53033 -> -+0.70711
    eps = 1e-6
    sa, sb = math.sqrt(1 / 12) + eps, math.sqrt(2 * 0.375**2) + eps
    hi_a, lo_a = (1 / 3) / sa, (-1 / 6) / sa
    lo_b, hi_b = -0.375 / sb, 0.375 / sb
    adv = step_group_advantages(TURN_SPANS, STEP_STATES, STEP_REWARDS, ["a", "a", "b"], MASK, gamma=0.5)
    close(
        adv,
        [
            [hi_a, hi_a, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [lo_a, 0.0, 0.0, lo_a, lo_a, 0.0, 0.0, 0.0],
            [lo_b, lo_b, lo_b, 0.0, 0.0, 0.0, hi_b, 0.0],
        ],
        atol=1e-5,
    )
    # Without the std: R - mean over the step group.
    centred = step_group_advantages(
        TURN_SPANS, STEP_STATES, STEP_REWARDS, ["a", "a", "b"], MASK, gamma=0.5, normalize_by_std=False
    )
    close(
        centred,
        [
            [1 / 3, 1 / 3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [-1 / 6, 0.0, 0.0, -1 / 6, -1 / 6, 0.0, 0.0, 0.0],
            [-0.375, -0.375, -0.375, 0.0, 0.0, 0.0, 0.375, 0.0],
        ],
    )


def test_step_groups_are_within_a_group_and_prefer_the_shorter_success() -> None:
    # The same states in different groups are not compared: each row alone in its group -> 0.
    alone = step_group_advantages(TURN_SPANS[:2], STEP_STATES[:2], STEP_REWARDS[:2], ["a", "b"], MASK[:2])
    close(alone, torch.zeros(2, 8).tolist())
    # Two successes from the start state, in 2 and 3 turns: with gamma < 1 the shorter one is better
    # (0.9 vs 0.81), with gamma 1 they are equal and nothing is learned at the start.
    spans, states = [[(0, 2), (4, 6)], [(0, 3), (4, 5), (6, 7)]], [["s0", "x"], ["s0", "y", "z"]]
    rewards = [[0.0, 1.0], [0.0, 0.0, 1.0]]
    mask = MASK[[0, 2]]
    discounted = step_group_advantages(spans, states, rewards, [0, 0], mask, gamma=0.9)
    assert float(discounted[0, 0]) > 0 > float(discounted[1, 0])
    close(step_group_advantages(spans, states, rewards, [0, 0], mask, gamma=1.0), torch.zeros(2, 8).tolist())


def test_step_group_advantages_stay_on_sampled_tokens_and_check_input() -> None:
    spans = [[(0, 2), (4, 6)], [(0, 3), (3, 5)], [(0, 3), (4, 5), (6, 7)]]  # row 1's first span covers an observation
    adv = step_group_advantages(spans, STEP_STATES, STEP_REWARDS, [0, 0, 0], MASK)
    assert float((adv * (1 - MASK)).abs().sum()) == 0.0
    with pytest.raises(ValueError, match="turn spans/states/rewards"):
        step_group_advantages(TURN_SPANS[:2], STEP_STATES, STEP_REWARDS, [0, 0, 0], MASK)
    with pytest.raises(ValueError, match="2 turn spans, 1 states"):
        step_group_advantages(TURN_SPANS, [["s0"], *STEP_STATES[1:]], STEP_REWARDS, [0, 0, 0], MASK)


def test_scale_negative_advantages() -> None:
    adv = torch.tensor([[1.5, -0.5, 0.0], [-2.0, 0.25, -0.0]])
    close(scale_negative_advantages(adv, 0.25), [[1.5, -0.125, 0.0], [-0.5, 0.25, 0.0]])
    close(scale_negative_advantages(adv, 0.0), [[1.5, 0.0, 0.0], [0.0, 0.25, 0.0]])
    assert scale_negative_advantages(adv, 1.0) is adv  # the plain estimator, untouched
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="scale must be in"):
            scale_negative_advantages(adv, bad)
