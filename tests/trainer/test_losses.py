"""Losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from agentgym.trainer.losses import (
    aggregate_loss,
    dpo_loss,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    linear_token_logprobs,
    policy_loss,
    sft_loss,
    token_logprobs,
    value_loss,
)


def close(actual: torch.Tensor, expected: float | list[float] | list[list[float]], atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------


def test_aggregation_modes() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # token-mean: (1 + 2 + 4 + 5 + 6) / 5 = 3.6
    close(aggregate_loss(loss, mask, "token-mean"), 3.6)
    # seq-mean-token-mean: rows (1 + 2)/2 = 1.5 and 15/3 = 5; the empty row is left out: 3.25
    close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 3.25)
    # seq-mean-token-sum: rows 3 and 15 -> 9
    close(aggregate_loss(loss, mask, "seq-mean-token-sum"), 9.0)
    # all masked: 0
    close(aggregate_loss(loss, torch.zeros(3, 3), "token-mean"), 0.0)
    close(aggregate_loss(loss, torch.zeros(3, 3), "seq-mean-token-mean"), 0.0)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(loss, mask, "sum")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# PPO policy loss
# ---------------------------------------------------------------------------------------------

# clip_low = 0.2, clip_high = 0.28: the ratio is clipped to [0.8, 1.28].
RATIOS = [[0.5, 0.5, 1.5, 1.5], [1.25, 1.0, 0.7, 3.0]]
ADV = torch.tensor([[1.0, -1.0, 1.0, -1.0], [2.0, 1.0, -1.0, 0.5]])
PMASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
# per token l = max(-A r, -A clip(r)):
#   r0: (0.5, +1): max(-0.5, -0.8)  = -0.5   unclipped
#       (0.5, -1): max( 0.5,  0.8)  =  0.8   CLIPPED (low side, A < 0)
#       (1.5, +1): max(-1.5, -1.28) = -1.28  CLIPPED (high side, A > 0)
#       (1.5, -1): max( 1.5,  1.28) =  1.5   unclipped
#   r1: (1.25, +2): max(-2.5, -2.5) = -2.5   unclipped (inside 1 + 0.28; a symmetric 0.2 clips it)
#       (1.0, +1):  -1                        unclipped
#       (0.7, -1):  max(0.7, 0.8)    =  0.8   CLIPPED (low side)
#       (3.0, +0.5): masked
# token-mean: (-0.5 + 0.8 - 1.28 + 1.5 - 2.5 - 1 + 0.8) / 7 = -2.18 / 7
# seq-mean-token-mean: row 0 0.52 / 4 = 0.13, row 1 -2.7 / 3 = -0.9 -> -0.385
# seq-mean-token-sum: (0.52 - 2.7) / 2 = -1.09


def _logprobs() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((2, 4), -1.0)
    new = (old + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    return new, old


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [("token-mean", -2.18 / 7), ("seq-mean-token-mean", -0.385), ("seq-mean-token-sum", -1.09)],
)
def test_policy_loss_asymmetric_clipping(aggregation: str, expected: float) -> None:
    new, old = _logprobs()
    loss, _ = policy_loss(new, old, ADV, PMASK, clip_low=0.2, clip_high=0.28, aggregation=aggregation)  # type: ignore[arg-type]
    close(loss, expected)


def test_policy_loss_stats_and_gradient() -> None:
    new, old = _logprobs()
    loss, stats = policy_loss(new, old, ADV, PMASK, clip_low=0.2, clip_high=0.28)
    # clipped tokens: (0, 1), (0, 2), (1, 2) of 7 sampled; low side 2, high side 1
    close(stats.clip_fraction, 3 / 7)
    close(stats.clip_fraction_low, 2 / 7)
    close(stats.clip_fraction_high, 1 / 7)
    close(stats.dual_clip_fraction, 0.0)
    # ratio mean (0.5 + 0.5 + 1.5 + 1.5 + 1.25 + 1 + 0.7) / 7 = 6.95 / 7
    close(stats.ratio_mean, 6.95 / 7)
    # approx KL = mean(r - 1 - ln r)
    kl = sum(r - 1 - math.log(r) for r in [0.5, 0.5, 1.5, 1.5, 1.25, 1.0, 0.7]) / 7
    close(stats.approx_kl, kl)
    assert set(stats.as_dict()) == {
        "clip_fraction",
        "clip_fraction_low",
        "clip_fraction_high",
        "dual_clip_fraction",
        "approx_kl",
        "ratio_mean",
    }
    # d l / d logp = -A r on unclipped tokens, 0 on clipped and masked ones; token-mean / 7
    loss.backward()
    assert new.grad is not None
    close(
        new.grad,
        [[-0.5 / 7, 0.0, 0.0, 1.5 / 7], [-2.5 / 7, -1.0 / 7, 0.0, 0.0]],
    )


def test_policy_loss_symmetric_clip_clips_the_high_ratio() -> None:
    # with clip_high = 0.2 (range [0.8, 1.2]):
    #   (1.25, +2) becomes max(-2.5, -2.4) = -2.4 (+0.1) and counts as clipped
    #   (1.5, +1) becomes max(-1.5, -1.2) = -1.2 (+0.08 against -1.28)
    # token-mean (-2.18 + 0.1 + 0.08) / 7 = -2 / 7
    new, old = _logprobs()
    loss, stats = policy_loss(new, old, ADV, PMASK, clip_low=0.2, clip_high=0.2)
    close(loss, -2.0 / 7)
    close(stats.clip_fraction, 4 / 7)


def test_policy_loss_dual_clip() -> None:
    # c = 3, range [0.8, 1.28]:
    #   (r=4, A=-1): max(4, 1.28) = 4 -> min(4, 3) = 3   dual-clipped, no gradient
    #   (r=2, A=-1): max(2, 1.28) = 2 -> min(2, 3) = 2
    #   (r=4, A=+1): max(-4, -1.28) = -1.28  (dual clip only for A < 0)
    # token-mean (3 + 2 - 1.28) / 3 = 1.24
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[4.0, 2.0, 4.0]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, stats = policy_loss(new, old, adv, torch.ones(1, 3), 0.2, 0.28, dual_clip=3.0)
    close(loss, 1.24)
    close(stats.dual_clip_fraction, 1 / 3)
    loss.backward()
    assert new.grad is not None
    # only the middle token has a gradient: -A r / 3 = 2 / 3
    close(new.grad, [[0.0, 2.0 / 3, 0.0]])
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(new, old, adv, torch.ones(1, 3), dual_clip=1.0)


# ---------------------------------------------------------------------------------------------
# KL, entropy
# ---------------------------------------------------------------------------------------------


def test_kl_estimators_at_given_values() -> None:
    logp = torch.tensor([[-1.0, -2.0, -1.5]])
    ref = torch.tensor([[-2.0, -1.0, -1.5]])
    # d = logp - ref = [1, -1, 0]
    close(kl_penalty(logp, ref, "k1"), [[1.0, -1.0, 0.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.5, 0.5, 0.0]])  # d^2 / 2
    # k3 = exp(ref - logp) - (ref - logp) - 1: e^-1 + 1 - 1 = 0.367879; e^1 - 1 - 1 = 0.718282; 0
    close(kl_penalty(logp, ref, "k3"), [[math.exp(-1.0), math.e - 2.0, 0.0]])
    # as a loss, masked token-mean over the first two: (0.367879 + 0.718282) / 2
    close(kl_loss(logp, ref, torch.tensor([[1, 1, 0]]), "k3"), (math.exp(-1.0) + math.e - 2.0) / 2)
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_entropy() -> None:
    # uniform over 4: ln 4; probs [1/8, 3/8, 2/8, 2/8] (logits ln 1, ln 3, ln 2, ln 2):
    #   H = 1/8 ln 8 + 3/8 ln(8/3) + 2 * 1/4 ln 4
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), math.log(2), math.log(2)]]])
    h2 = math.log(8) / 8 + 3 / 8 * math.log(8 / 3) + 0.5 * math.log(4)
    close(entropy_from_logits(logits), [[math.log(4), h2]])
    close(entropy_bonus(logits, torch.tensor([[1, 0]])), math.log(4))
    close(entropy_bonus(logits, torch.tensor([[1, 1]])), (math.log(4) + h2) / 2)


# ---------------------------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------------------------


def test_value_loss_clipping() -> None:
    # clip_range 0.2:
    #   t0: old 0.5, v 1.0, R 1.0: unclipped 0; v_clip = 0.7 -> 0.09; max 0.09  (clipped branch)
    #   t1: old 0.5, v 0.6, R 1.0: 0.16 both                                    (within range)
    #   t2: old 0.5, v 0.0, R 1.0: unclipped 1.0; v_clip 0.3 -> 0.49; max 1.0  (unclipped branch)
    #   t3: masked
    # 1/2 * (0.09 + 0.16 + 1.0) / 3 = 0.208333
    values = torch.tensor([[1.0, 0.6, 0.0, 1.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip_range=0.2)
    close(loss, 0.5 * 1.25 / 3)
    close(stats.clip_fraction, 1 / 3)
    close(stats.value_mean, 1.6 / 3)
    loss.backward()
    assert values.grad is not None
    # gradient (v - R) / 3 on the unclipped branch, 0 through the clipped one and on masked tokens
    close(values.grad, [[0.0, -0.4 / 3, -1.0 / 3, 0.0]])
    # without clipping: 1/2 * (0 + 0.16 + 1.0) / 3
    loss_nc, stats_nc = value_loss(values, old, returns, mask, clip_range=None)
    close(loss_nc, 0.5 * 1.16 / 3)
    close(stats_nc.clip_fraction, 0.0)


def test_value_loss_explained_variance() -> None:
    # R = [1, 2, 3], V = [1, 2, 2]: error [0, 0, 1], Var(err) = (1/9 + 1/9 + 4/9) / 3 = 2/9,
    # Var(R) = 2/3 -> 1 - (2/9) / (2/3) = 2/3
    _, stats = value_loss(
        torch.tensor([[1.0, 2.0, 2.0]]), torch.tensor([[1.0, 2.0, 2.0]]), torch.tensor([[1.0, 2.0, 3.0]]),
        torch.ones(1, 3), clip_range=0.2,
    )  # fmt: skip
    close(stats.explained_variance, 2 / 3)


# ---------------------------------------------------------------------------------------------
# SFT, DPO
# ---------------------------------------------------------------------------------------------


def test_sft_loss_token_mean() -> None:
    # row 0: t0 logits [0, 0, 0], label 1 -> -ln(1/3) = ln 3
    #        t1 logits [0, ln 3, 0], label 1 -> p = 3/5 -> ln(5/3)
    #        t2 masked (label -100, logits that would give a huge loss)
    # row 1: t0 logits [ln 2, 0, 0], label 0 -> p = 2/4 -> ln 2; t1, t2 masked
    # token-mean (ln 3 + ln 5/3 + ln 2) / 3 = ln 10 / 3  (a per-sequence mean would be 0.7489)
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0], [0.0, math.log(3), 0.0], [100.0, 0.0, 0.0]],
            [[math.log(2), 0.0, 0.0], [0.0, 50.0, 0.0], [0.0, 0.0, 0.0]],
        ]
    )
    labels = torch.tensor([[1, 1, -100], [0, 0, 2]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(sft_loss(logits, labels, mask), math.log(10) / 3)
    close(token_logprobs(logits, labels)[0, :2], [-math.log(3), -math.log(5 / 3)])


def test_dpo_loss() -> None:
    # chosen: -1 - (-2) = 1; rejected: -3 - (-2) = -1; h = 2; beta h = 0.2
    # L = -log sigmoid(0.2) = log(1 + e^-0.2) = 0.598139
    pc, pr = torch.tensor([-1.0]), torch.tensor([-3.0])
    rc, rr = torch.tensor([-2.0]), torch.tensor([-2.0])
    loss, r_c, r_r = dpo_loss(pc, pr, rc, rr, beta=0.1)
    close(loss, math.log1p(math.exp(-0.2)))
    close(r_c, [0.1])
    close(r_r, [-0.1])
    # label smoothing 0.1: 0.9 log(1 + e^-0.2) + 0.1 log(1 + e^0.2)
    loss_s, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    close(loss_s, 0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2)))


# ---------------------------------------------------------------------------------------------
# LM head and label log-probs in one op
# ---------------------------------------------------------------------------------------------


def test_linear_token_logprobs_by_hand() -> None:
    # H = 1, V = 3: W = [1, 2, 0], h = 1, label 1 -> z = [1, 2, 0]
    weight = torch.tensor([[1.0], [2.0], [0.0]], dtype=torch.float64, requires_grad=True)
    hidden = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    logp, entropy = linear_token_logprobs(hidden, weight, torch.tensor([1]), with_entropy=True)
    total = math.e + math.e**2 + 1.0
    p = [math.e / total, math.e**2 / total, 1.0 / total]
    close(logp, [2.0 - math.log(total)], atol=1e-12)
    close(entropy, [-sum(q * math.log(q) for q in p)], atol=1e-12)
    (3.0 * logp).sum().backward()  # upstream gradient 3
    # d logp / d z_v = 1[v = 1] - p_v; d z_v / d h = W_v, d z_v / d W_v = h = 1
    dz = [-p[0], 1.0 - p[1], -p[2]]
    assert hidden.grad is not None and weight.grad is not None
    close(hidden.grad, [[3.0 * (dz[0] * 1.0 + dz[1] * 2.0 + dz[2] * 0.0)]], atol=1e-12)
    close(weight.grad, [[3.0 * d] for d in dz], atol=1e-12)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_linear_token_logprobs_match_log_softmax(with_entropy: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    weight0 = torch.randn(11, 5, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 11, (7,), generator=generator)
    upstream = torch.randn(7, generator=generator, dtype=torch.float64)

    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    logp, entropy = linear_token_logprobs(hidden, weight, labels, with_entropy)
    (upstream * logp).sum().backward()

    hidden_ref, weight_ref = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    logits = hidden_ref @ weight_ref.t()
    logp_ref = torch.log_softmax(logits, dim=-1).gather(1, labels[:, None])[:, 0]
    (upstream * logp_ref).sum().backward()

    torch.testing.assert_close(logp, logp_ref.detach(), atol=1e-12, rtol=0)
    z = logits.detach()
    expected_entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    if not with_entropy:
        expected_entropy = torch.zeros(7, dtype=torch.float64)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-12, rtol=0)
    assert not entropy.requires_grad  # a metric
    torch.testing.assert_close(hidden.grad, hidden_ref.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(weight.grad, weight_ref.grad, atol=1e-12, rtol=0)


def test_linear_token_logprobs_entropy_is_float32_under_autocast() -> None:
    """Under bf16 autocast the head's matmul runs in bf16, but the entropy is computed in float32 from its logits:
    -sum_v p_v log p_v of z = bf16(h) bf16(W)^T, to float32 rounding (a bf16 dot product would be off by ~1e-2)."""
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 32, generator=generator)
    weight = torch.randn(5000, 32, generator=generator) * 0.3
    labels = torch.randint(0, 5000, (6,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = linear_token_logprobs(hidden, weight, labels, with_entropy=True)
    z = (hidden.bfloat16() @ weight.bfloat16().t()).double()
    expected = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy.double(), expected, atol=1e-4, rtol=1e-5)
    expected_logp = torch.log_softmax(z, -1).gather(1, labels[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), expected_logp, atol=1e-4, rtol=0)


def test_linear_token_logprobs_under_checkpoint_and_shared_weight() -> None:
    # The tied embedding: the head weight also feeds the input side; gradients add up.
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(9, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    ids, labels = torch.tensor([1, 5, 2]), torch.tensor([5, 2, 8])

    def loss(fn: object) -> torch.Tensor:
        hidden = torch.tanh(weight[ids])
        if fn is None:
            return torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, labels[:, None]).sum()
        logp = torch.utils.checkpoint.checkpoint(
            lambda h: linear_token_logprobs(h, weight, labels)[0], hidden, use_reentrant=False
        )
        return logp.sum()

    (grad_ref,) = torch.autograd.grad(loss(None), weight)
    (grad,) = torch.autograd.grad(loss(linear_token_logprobs), weight)
    torch.testing.assert_close(grad, grad_ref, atol=1e-12, rtol=0)


def test_linear_token_logprobs_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="hidden"):
        linear_token_logprobs(torch.zeros(2, 3), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        linear_token_logprobs(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long))
