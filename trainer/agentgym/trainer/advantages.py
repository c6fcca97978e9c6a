"""Advantage estimators for multi-turn LLM-agent RL: GRPO, RLOO, REINFORCE++ and PPO-GAE.

Batch layout
============
A multi-turn trajectory is ONE token sequence::

    prompt | action_1  observation_1 | action_2  observation_2 | ... | action_K  [padding]
           '------------------------- response part --------------------------------'

All per-token tensors here are ``[B, T]`` over the *response part* only (the prompt is cut off),
right-padded to a common length ``T``:

``response_mask``
    1 on model-sampled tokens (the action tokens of every turn), 0 on observation tokens written
    by the environment and on padding. Only masked-in tokens get a gradient, and only they take
    part in returns, GAE, whitening and loss aggregation. Any dtype (bool, int or float).
``token_rewards``
    Rewards placed on tokens. The reward of turn ``k`` sits on the LAST SAMPLED token of that
    turn's action, and the final/outcome reward on the last sampled token of the last turn
    (:func:`last_sampled_index`). It is never placed on the last position of the row: that is an
    observation or padding token, masked out, and a reward put there is silently lost by any
    estimator that only looks at sampled tokens (the bug in AgentGym-RL's PPO-GAE and
    REINFORCE++). Build it with :func:`place_turn_rewards` / :func:`place_outcome_rewards`;
    :func:`gae_advantages` and :func:`reinforce_plus_plus_advantages` raise ``ValueError`` when a
    non-zero reward sits on a masked token.
``scores``
    ``[B]`` outcome score of each trajectory (GRPO, RLOO).
``group_ids``
    ``[B]`` LongTensor or a sequence of hashables (e.g. the ``group_id`` strings of the
    trajectories): trajectories of the same task sampled for the same step share a group.
``values``
    ``[B, T]`` critic values ``V(s_t)`` for PPO-GAE, read on sampled tokens only.

Every estimator returns advantages of shape ``[B, T]`` that are exactly 0 on masked tokens.

Conventions
===========
* Group standard deviation (GRPO): UNBIASED (Bessel, ``n - 1``), as ``torch.std`` in the
  GRPO implementations this platform is compared with (DeepSeekMath / verl, used by AgentGym-RL,
  and TRL), so advantage scales match the paper recipe.
* Singleton groups (GRPO and RLOO): advantage 0. One sample has no baseline to compare with
  (its leave-one-out set is empty and its unbiased std undefined); verl instead returns the raw
  score there, a non-centred signal we deliberately do not reproduce.
* Discounting over masked tokens (REINFORCE++, GAE): the recursions run over SAMPLED tokens
  only. Observation and padding tokens are skipped: they neither discount nor carry value, so
  ``gamma`` is applied once per sampled-token step; the "next" token of a sampled token is the
  next sampled token, across any observation in between, and the last sampled token of a row is
  terminal (next value 0, also for episodes cut by the horizon: there is no next state to value).
* Whitening (:func:`masked_whiten`): mean and UNBIASED variance over the sampled tokens of the
  whole batch, ``(x - mean) / sqrt(var + eps)`` with ``eps = 1e-8``; masked positions are set to 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "check_rewards_on_sampled_tokens",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalized_rewards",
    "last_sampled_index",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "place_outcome_rewards",
    "place_turn_rewards",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "sampled_spans",
    "scale_negative_advantages",
    "step_group_advantages",
    "turn_returns",
    "turn_validity_advantages",
]

GroupIds = Tensor | Sequence[Hashable]


# --------------------------------------------------------------------------------------------
# masked statistics
# --------------------------------------------------------------------------------------------


def _float_dtype(*tensors: Tensor) -> torch.dtype:
    """At least float32 (bf16/fp16 inputs are promoted so recursions and sums stay accurate)."""
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is non-zero: ``sum(x * m) / sum(m)``.

    With ``dim=None`` the mean is over all masked-in elements; otherwise along ``dim``.
    An empty selection gives 0 (the denominator is clamped to at least 1).
    """
    m = mask.to(x.dtype if x.is_floating_point() else torch.float32)
    total = (x * m).sum() if dim is None else (x * m).sum(dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked-in elements.

    ``sum(m * (x - mean)^2) / (n - 1)`` when ``unbiased`` (Bessel), ``/ n`` otherwise, with
    ``n = sum(m)``. Fewer than 2 elements (unbiased) or none (population) gives 0.
    """
    m = mask.to(x.dtype if x.is_floating_point() else torch.float32)
    mean = masked_mean(x, m)
    n = m.sum()
    sq = ((x - mean) ** 2 * m).sum()
    denom = n - 1.0 if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp(min=1e-12), torch.zeros_like(sq))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` with statistics of its masked-in elements.

    ``(x - mean) / sqrt(var + eps)`` (``var`` unbiased, see :func:`masked_var`); with
    ``shift_mean=False`` the mean is added back: ``(x - mean) / sqrt(var + eps) + mean``.
    Masked-out positions of the result are 0.
    """
    m = mask.to(x.dtype if x.is_floating_point() else torch.float32)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


# --------------------------------------------------------------------------------------------
# reward placement
# --------------------------------------------------------------------------------------------


def _check_mask(response_mask: Tensor) -> None:
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")


def last_sampled_index(response_mask: Tensor) -> Tensor:
    """Index of the last sampled (masked-in) token of each row, LongTensor ``[B]``; -1 if none.

    This is where the outcome reward of a trajectory goes, NOT ``T - 1`` or the row's last
    non-padding token (which is usually the final observation, a masked token).
    """
    _check_mask(response_mask)
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    marked = torch.where(response_mask != 0, positions, torch.full_like(positions, -1))
    if response_mask.shape[1] == 0:
        return torch.full((response_mask.shape[0],), -1, dtype=torch.long, device=response_mask.device)
    return marked.max(dim=1).values


def sampled_spans(response_mask: Tensor) -> list[list[tuple[int, int]]]:
    """Maximal runs of sampled tokens of each row, as ``[start, end)`` pairs.

    With an observation between any two actions these are exactly the action spans of the turns.
    """
    _check_mask(response_mask)
    spans: list[list[tuple[int, int]]] = []
    for row in (response_mask != 0).tolist():
        row_spans: list[tuple[int, int]] = []
        start: int | None = None
        for t, sampled in enumerate(row):
            if sampled and start is None:
                start = t
            elif not sampled and start is not None:
                row_spans.append((start, t))
                start = None
        if start is not None:
            row_spans.append((start, len(row)))
        spans.append(row_spans)
    return spans


def place_turn_rewards(
    response_mask: Tensor,
    turn_ends: Sequence[Sequence[int]] | None,
    turn_rewards: Sequence[Sequence[float]] | None,
    outcome_rewards: Tensor | Sequence[float] | None = None,
) -> Tensor:
    """Token rewards ``[B, T]`` from per-turn rewards (and an optional outcome reward per row).

    Turn boundaries: ``turn_ends[b][k]`` is the exclusive end of turn ``k`` of row ``b``; turn ``k``
    covers ``[turn_ends[b][k-1], turn_ends[b][k])`` (``0`` for ``k = 0``). Either the action end or
    the observation end of each turn works (``Turn.action_end`` / ``Turn.observation_end`` of the
    Trajectory contract): the reward ``turn_rewards[b][k]`` is put on the LAST SAMPLED token inside
    that segment. ``turn_ends=None`` takes the turns to be the runs of sampled tokens
    (:func:`sampled_spans`). ``outcome_rewards[b]`` is added on :func:`last_sampled_index` of row
    ``b``. Rewards landing on the same token add up.

    Raises ``ValueError`` on boundaries that are not strictly increasing within ``[1, T]``, on a
    count mismatch, and when a NON-ZERO reward has no sampled token to sit on (a zero one is
    dropped: such a row has no token to train anyway).
    """
    _check_mask(response_mask)
    batch, length = response_mask.shape
    dtype = torch.float32 if not response_mask.is_floating_point() else _float_dtype(response_mask)
    sampled = (response_mask != 0).tolist()
    rewards = [[0.0] * length for _ in range(batch)]

    if turn_rewards is not None:
        if len(turn_rewards) != batch:
            raise ValueError(f"turn_rewards has {len(turn_rewards)} rows, batch has {batch}")
        if turn_ends is None:
            ends: Sequence[Sequence[int]] = [[end for _, end in row] for row in sampled_spans(response_mask)]
        else:
            if len(turn_ends) != batch:
                raise ValueError(f"turn_ends has {len(turn_ends)} rows, batch has {batch}")
            ends = turn_ends
        for b in range(batch):
            if len(ends[b]) != len(turn_rewards[b]):
                raise ValueError(f"row {b}: {len(turn_rewards[b])} turn rewards for {len(ends[b])} turn boundaries")
            start = 0
            for k, (end, reward) in enumerate(zip(ends[b], turn_rewards[b], strict=True)):
                if not start < end <= length:
                    raise ValueError(
                        f"row {b}: turn {k} ends at {end}, boundaries must increase strictly within [1, {length}]"
                    )
                last = next((t for t in range(end - 1, start - 1, -1) if sampled[b][t]), -1)
                if last < 0:
                    if reward != 0:
                        raise ValueError(f"row {b}: turn {k} ([{start}, {end})) has no sampled token")
                else:
                    rewards[b][last] += float(reward)
                start = end

    if outcome_rewards is not None:
        outcome = torch.as_tensor(outcome_rewards).reshape(-1).tolist()
        if len(outcome) != batch:
            raise ValueError(f"outcome_rewards has {len(outcome)} entries, batch has {batch}")
        for b, last in enumerate(last_sampled_index(response_mask).tolist()):
            if last < 0:
                if outcome[b] != 0:
                    raise ValueError(f"row {b} has no sampled token for its outcome reward")
            else:
                rewards[b][last] += float(outcome[b])

    return torch.tensor(rewards, dtype=dtype, device=response_mask.device).reshape(batch, length)


def place_outcome_rewards(response_mask: Tensor, scores: Tensor | Sequence[float]) -> Tensor:
    """Token rewards ``[B, T]`` holding ``scores[b]`` on the last sampled token of row ``b``, 0 elsewhere."""
    return place_turn_rewards(response_mask, None, None, outcome_rewards=scores)


def check_rewards_on_sampled_tokens(token_rewards: Tensor, response_mask: Tensor) -> None:
    """Raise ``ValueError`` if a non-zero reward sits on a masked (observation/padding) token."""
    if token_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)} and response_mask {tuple(response_mask.shape)} differ in shape"
        )
    lost = (token_rewards != 0) & (response_mask == 0)
    if bool(lost.any()):
        b, t = (int(i) for i in lost.nonzero()[0])
        raise ValueError(
            f"non-zero reward on masked token (row {b}, position {t}): it would be lost; place "
            "rewards on the last sampled token of a turn (place_turn_rewards / last_sampled_index)"
        )


def kl_penalized_rewards(
    token_rewards: Tensor, response_mask: Tensor, kl_per_token: Tensor | None, kl_coef: float
) -> Tensor:
    """``(token_rewards - kl_coef * kl_per_token) * response_mask``: the KL-in-reward penalty.

    ``kl_per_token`` is e.g. :func:`agentgym.trainer.losses.kl_penalty` of the sampled tokens
    against the reference policy (treated as a constant: it is detached).
    """
    dtype = _float_dtype(token_rewards)
    m = response_mask.to(dtype)
    rewards = token_rewards.to(dtype)
    if kl_per_token is not None and kl_coef != 0.0:
        if kl_per_token.shape != token_rewards.shape:
            raise ValueError("kl_per_token must have the shape of token_rewards")
        rewards = rewards - kl_coef * kl_per_token.detach().to(dtype)
    return rewards * m


# --------------------------------------------------------------------------------------------
# group baselines: GRPO and RLOO
# --------------------------------------------------------------------------------------------


def _group_index(group_ids: GroupIds, batch: int, device: torch.device) -> tuple[Tensor, int]:
    """Dense group index ``[B]`` in ``0..G-1`` and the number of groups ``G``."""
    if isinstance(group_ids, Tensor):
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids must be [{batch}], got {tuple(group_ids.shape)}")
        _, index = torch.unique(group_ids, return_inverse=True)
        return index.to(device), int(index.max()) + 1 if batch else 0
    if len(group_ids) != batch:
        raise ValueError(f"group_ids has {len(group_ids)} entries, batch has {batch}")
    dense: dict[Hashable, int] = {}
    index_list = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index_list, dtype=torch.long, device=device), len(dense)


def _group_sums(scores: Tensor, index: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """Per-trajectory (sum of its group's scores, size of its group), both ``[B]``."""
    sums = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, scores)
    counts = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, torch.ones_like(scores))
    return sums[index], counts[index]


def _check_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    _check_mask(response_mask)
    if scores.shape != (response_mask.shape[0],):
        raise ValueError(f"scores must be [{response_mask.shape[0]}], got {tuple(scores.shape)}")
    return scores.to(_float_dtype(scores))


def grpo_advantages(
    scores: Tensor,
    group_ids: GroupIds,
    response_mask: Tensor,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024), broadcast over each row's sampled tokens.

    For trajectory ``i`` in group ``g`` of size ``n_g``::

        A_i = (r_i - mean_g) / (std_g + eps)    (normalize_by_std=True)
        A_i =  r_i - mean_g                     (normalize_by_std=False, Dr. GRPO style)
        std_g = sqrt( sum_{j in g} (r_j - mean_g)^2 / (n_g - 1) )    (unbiased)
        A_i = 0  if n_g == 1

    A group whose scores are all equal gets 0. Returns ``[B, T]``: ``A_i * response_mask``.
    """
    r = _check_scores(scores, response_mask)
    index, groups = _group_index(group_ids, r.shape[0], r.device)
    sums, counts = _group_sums(r, index, groups)
    mean = sums / counts
    centred = r - mean
    sq_sums, _ = _group_sums(centred**2, index, groups)
    multi = counts > 1
    if normalize_by_std:
        std = torch.sqrt(sq_sums / torch.where(multi, counts - 1, torch.ones_like(counts)))
        adv = centred / (std + eps)
    else:
        adv = centred
    adv = torch.where(multi, adv, torch.zeros_like(adv))
    return adv.unsqueeze(1) * response_mask.to(adv.dtype)


def rloo_advantages(scores: Tensor, group_ids: GroupIds, response_mask: Tensor) -> Tensor:
    """RLOO advantages (Ahmadian et al. 2024): leave-one-out group baseline.

    For trajectory ``i`` in group ``g`` of size ``n_g``::

        A_i = r_i - (1 / (n_g - 1)) * sum_{j in g, j != i} r_j  =  n_g / (n_g - 1) * (r_i - mean_g)
        A_i = 0  if n_g == 1

    Returns ``[B, T]``: ``A_i * response_mask``.
    """
    r = _check_scores(scores, response_mask)
    index, groups = _group_index(group_ids, r.shape[0], r.device)
    sums, counts = _group_sums(r, index, groups)
    multi = counts > 1
    baseline = (sums - r) / torch.where(multi, counts - 1, torch.ones_like(counts))
    adv = torch.where(multi, r - baseline, torch.zeros_like(r))
    return adv.unsqueeze(1) * response_mask.to(adv.dtype)


def scale_negative_advantages(advantages: Tensor, scale: float) -> Tensor:
    """Negative advantages scaled by ``scale`` in [0, 1]; positive ones kept::

        A'_t = A_t            if A_t >= 0
        A'_t = scale * A_t    if A_t <  0

    A policy-gradient update splits into reinforcing what worked (positive advantages) and
    suppressing what did not (negative ones; Zhu et al. 2025 study the two halves apart). Pushing a
    sampled token down hands its probability to every other token of the vocabulary, so the negative
    half raises entropy; on a small model with a large vocabulary that mass reaches stray tokens
    and malformed replies follow. ``scale`` < 1 weakens that half; 1 is the unscaled estimator and
    0 keeps only the positive half (advantage-weighted imitation of the better samples).
    """
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"scale must be in [0, 1], got {scale}")
    if scale == 1.0:
        return advantages
    return torch.where(advantages < 0, advantages * scale, advantages)


def _put_normalised_turn_values(
    out: Tensor, turn_sets: Iterable[Sequence[tuple[int, int, int, float]]], normalize_by_std: bool, eps: float
) -> None:
    """Write each set's values, centred (and divided by the set's unbiased std), on their turns' spans.

    A set item is ``(row, start, end, value)``. Sets of fewer than 2 turns, or of equal values, write nothing.
    """
    for turns in turn_sets:
        if len(turns) < 2:
            continue
        values = torch.tensor([t[3] for t in turns], dtype=torch.float64)
        std = float(values.std())
        if std == 0.0:
            continue
        centred = values - values.mean()
        normalised = (centred / (std + eps) if normalize_by_std else centred).tolist()
        for (row, start, end, _), value in zip(turns, normalised, strict=True):
            out[row, start:end] = value


def turn_validity_advantages(
    turn_spans: Sequence[Sequence[tuple[int, int]]],
    turn_invalid: Sequence[Sequence[bool]],
    group_ids: GroupIds,
    response_mask: Tensor,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
    success: Sequence[bool] | None = None,
) -> Tensor:
    """Turn-level credit from action validity, normalised within each group's turns.

    Outcome advantages give every turn of a trajectory the same credit, so a malformed turn in a
    successful episode is pushed up and the well-formed turns of a failed one are pushed down. The
    environment already says which turns were invalid (the action did not parse, or was rejected):
    that is a reward for the turn itself. Like GRPO's process supervision (Shao et al. 2024, 4.1.3)
    the turn rewards of a group are z-normalised over all of the group's turns, but each turn keeps
    its own value (validity is a property of the turn's text, not of what follows)::

        v_{i,k} = -1 if turn k of trajectory i was invalid, else 0
        A_{i,k} = (v_{i,k} - mean_g(v)) / (std_g(v) + eps)    over every turn of group g (unbiased std)
        A_{i,k} =  v_{i,k} - mean_g(v)                        (normalize_by_std=False, as Dr. GRPO)
        A_{i,k} = 0   when group g has fewer than 2 turns, or all of them are equally valid
        A_{i,k} = 0   when ``success`` is given and no trajectory of group g succeeded

    Why the last rule: where no sample of a group succeeded there is no outcome signal, so validity
    would be the whole of it, and the cheapest way to be valid is to stop trying what can fail (in
    BabyAI, ``go to X`` is rejected while X is out of view; turning in place never is). Gated on a
    success, validity only ranks the turns of groups that also show what reaches the goal.

    ``turn_spans[i]`` are the ``[start, end)`` response positions of trajectory ``i``'s turns
    (their sampled action tokens), ``turn_invalid[i]`` the matching flags, ``success[i]`` whether
    trajectory ``i`` succeeded. Returns ``[B, T]``: ``A_{i,k}`` on the sampled tokens of turn ``k``,
    0 elsewhere.
    """
    _check_mask(response_mask)
    batch = response_mask.shape[0]
    if len(turn_spans) != batch or len(turn_invalid) != batch:
        raise ValueError(f"turn spans/flags for {len(turn_spans)}/{len(turn_invalid)} rows, batch has {batch}")
    if success is not None and len(success) != batch:
        raise ValueError(f"success flags for {len(success)} rows, batch has {batch}")
    dtype = _float_dtype(response_mask)
    out = torch.zeros(response_mask.shape, dtype=dtype, device=response_mask.device)
    index, groups = _group_index(group_ids, batch, torch.device("cpu"))
    members: list[list[tuple[int, int, int, float]]] = [[] for _ in range(groups)]
    for row, (spans, invalid) in enumerate(zip(turn_spans, turn_invalid, strict=True)):
        if len(spans) != len(invalid):
            raise ValueError(f"row {row}: {len(spans)} turn spans but {len(invalid)} validity flags")
        for (start, end), bad in zip(spans, invalid, strict=True):
            members[int(index[row])].append((row, start, end, -1.0 if bad else 0.0))
    if success is not None:
        succeeded = {int(index[row]) for row, ok in enumerate(success) if ok}
        members = [turns if group in succeeded else [] for group, turns in enumerate(members)]
    _put_normalised_turn_values(out, members, normalize_by_std, eps)
    return out * response_mask.to(dtype)


def turn_returns(turn_rewards: Sequence[float], gamma: float) -> list[float]:
    """Discounted return from each turn of one trajectory, discounting once per turn::

        R_k = r_k + gamma * R_{k+1},    R_{K+1} = 0

    With only an outcome reward ``r`` on the last of ``K`` turns, ``R_k = gamma^(K-k) * r``: the
    same success is worth more from a turn closer to it.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    returns = [0.0] * len(turn_rewards)
    following = 0.0
    for k in range(len(turn_rewards) - 1, -1, -1):
        following = float(turn_rewards[k]) + gamma * following
        returns[k] = following
    return returns


def step_group_advantages(
    turn_spans: Sequence[Sequence[tuple[int, int]]],
    turn_states: Sequence[Sequence[Hashable]],
    turn_rewards: Sequence[Sequence[float]],
    group_ids: GroupIds,
    response_mask: Tensor,
    gamma: float = 0.95,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Step-level advantages over anchor states, GiGPO's inner groups (Feng et al. 2025).

    The samples of one group start from the same state and often pass through the same states
    again (the same observation after the same moves). The turns that acted from one such anchor
    state are a step-level group: there, different actions were taken from the same situation, and
    what followed says which was better. A turn is compared with the other turns of its group that
    saw the same state, by its discounted return::

        R_{i,k} = sum_{j >= k} gamma^(j-k) r_{i,j}                    (turn_returns; outcome on the last turn)
        S(i,k)  = {(i',k') : group(i') = group(i), s_{i',k'} = s_{i,k}}   (every trajectory, any turn)
        A_{i,k} = (R_{i,k} - mean_S(R)) / (std_S(R) + eps)            (unbiased std)
        A_{i,k} =  R_{i,k} - mean_S(R)                                (normalize_by_std=False)
        A_{i,k} = 0   when |S(i,k)| < 2, or every return in S is equal

    The first turn of every sample acts from the task's start: that step group is the whole group,
    and with ``gamma < 1`` it also prefers the samples that succeed in fewer turns. A state that
    recurs within one trajectory (turning in circles) joins the group once per visit.

    ``turn_spans[i]`` are the ``[start, end)`` response positions of trajectory ``i``'s turns (their
    sampled action tokens), ``turn_states[i]`` hashable keys of the state each turn acted from (equal
    keys: the same state) and ``turn_rewards[i]`` each turn's reward. Returns ``[B, T]``:
    ``A_{i,k}`` on the sampled tokens of turn ``k``, 0 elsewhere. Added to the episode-level (GRPO)
    advantage with a weight, as in GiGPO.
    """
    _check_mask(response_mask)
    batch = response_mask.shape[0]
    if not len(turn_spans) == len(turn_states) == len(turn_rewards) == batch:
        raise ValueError(
            f"turn spans/states/rewards for {len(turn_spans)}/{len(turn_states)}/{len(turn_rewards)} rows, "
            f"batch has {batch}"
        )
    dtype = _float_dtype(response_mask)
    out = torch.zeros(response_mask.shape, dtype=dtype, device=response_mask.device)
    index, _ = _group_index(group_ids, batch, torch.device("cpu"))
    step_groups: dict[tuple[int, Hashable], list[tuple[int, int, int, float]]] = {}
    for row, (spans, states, rewards) in enumerate(zip(turn_spans, turn_states, turn_rewards, strict=True)):
        if not len(spans) == len(states) == len(rewards):
            raise ValueError(f"row {row}: {len(spans)} turn spans, {len(states)} states, {len(rewards)} rewards")
        for (start, end), state, value in zip(spans, states, turn_returns(rewards, gamma), strict=True):
            step_groups.setdefault((int(index[row]), state), []).append((row, start, end, value))
    _put_normalised_turn_values(out, step_groups.values(), normalize_by_std, eps)
    return out * response_mask.to(dtype)


# --------------------------------------------------------------------------------------------
# token-level estimators: REINFORCE++ and GAE
# --------------------------------------------------------------------------------------------


def reinforce_plus_plus_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    gamma: float,
    kl_per_token: Tensor | None = None,
    kl_coef: float = 0.0,
    whiten: bool = True,
) -> Tensor:
    """REINFORCE++ advantages (Hu 2025): KL-penalised discounted returns, batch-whitened.

    Over the sampled tokens ``s_1 < s_2 < ... < s_n`` of a row (observation tokens skipped, so the
    discount counts sampled-token steps)::

        r'_t = token_rewards_t - kl_coef * kl_t
        G_{s_k} = r'_{s_k} + gamma * G_{s_{k+1}},    G_{s_{n+1}} = 0
        A = (G - mean(G)) / sqrt(var(G) + 1e-8)      over all sampled tokens of the batch

    (``whiten=False`` returns ``G``.) ``token_rewards`` must be 0 on masked tokens (checked).
    Returns ``[B, T]``, 0 on masked tokens.
    """
    _check_mask(response_mask)
    check_rewards_on_sampled_tokens(token_rewards, response_mask)
    rewards = kl_penalized_rewards(token_rewards, response_mask, kl_per_token, kl_coef)
    sampled = response_mask != 0
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(sampled[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(sampled[:, t], running, torch.zeros_like(running))
    return masked_whiten(returns, sampled) if whiten else returns


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over sampled tokens; returns (A, R).

    Over the sampled tokens ``s_1 < ... < s_n`` of a row (observation tokens skipped: the next
    value of a sampled token is the value at the next SAMPLED token, the last one is terminal)::

        delta_{s_k} = r_{s_k} + gamma * V_{s_{k+1}} - V_{s_k},      V_{s_{n+1}} = 0
        A_{s_k}     = delta_{s_k} + gamma * lam * A_{s_{k+1}},       A_{s_{n+1}} = 0
        R_{s_k}     = A_{s_k} + V_{s_k}                              (value targets, never whitened)

    The terminal reward sits on ``s_n`` (checked: non-zero rewards on masked tokens raise), so it
    enters ``delta_{s_n}``. With ``whiten=True`` (the PPO default) the advantages, not the returns,
    are whitened over all sampled tokens (:func:`masked_whiten`). Values of masked tokens are never
    read. Both outputs are ``[B, T]``, 0 on masked tokens.
    """
    _check_mask(response_mask)
    check_rewards_on_sampled_tokens(token_rewards, response_mask)
    if values.shape != response_mask.shape:
        raise ValueError(f"values must be {tuple(response_mask.shape)}, got {tuple(values.shape)}")
    dtype = _float_dtype(token_rewards, values)
    sampled = response_mask != 0
    rewards = token_rewards.detach().to(dtype)
    vals = values.detach().to(dtype)
    advantages = torch.zeros_like(rewards)
    zero = torch.zeros_like(rewards[:, 0])
    next_value = zero
    next_adv = zero
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        on = sampled[:, t]
        advantages[:, t] = torch.where(on, adv_t, zero)
        next_adv = torch.where(on, adv_t, next_adv)
        next_value = torch.where(on, vals[:, t], next_value)
    returns = (advantages + vals) * sampled.to(dtype)
    if whiten:
        advantages = masked_whiten(advantages, sampled)
    return advantages, returns
