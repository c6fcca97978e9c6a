"""Losses for multi-turn LLM-agent RL and fine-tuning: PPO policy loss, KL, entropy, value, SFT, DPO.

Tensors follow the batch layout of :mod:`agentgym.trainer.advantages`: ``[B, T]`` over the response
part, ``response_mask`` 1 on model-sampled tokens only (observation tokens and padding are 0 and
never contribute to a loss or a statistic). Logits are ``[B, T, V]`` ALIGNED with the token they
score: ``logits[b, t]`` is the distribution the token at ``[b, t]`` was sampled from (the caller
does the usual one-position shift of a causal LM's output).

Loss aggregation (``aggregation``), for a per-token loss ``l`` and mask ``m``:

``"token-mean"``
    ``sum_{b,t} m l / sum_{b,t} m``: every sampled token weighs the same (DAPO's choice; long
    multi-turn trajectories are not down-weighted per token). The default.
``"seq-mean-token-mean"``
    mean over rows of ``sum_t m l / sum_t m``: every trajectory weighs the same (original GRPO).
``"seq-mean-token-sum"``
    mean over rows of ``sum_t m l`` (Dr. GRPO: no length normalisation inside a sequence).

In the two ``seq-mean`` modes the mean is over rows with at least one sampled token (a row with
none, e.g. an episode that failed before the model spoke, has no loss and does not dilute the
others). An all-masked batch gives a loss of 0 that is still part of the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Aggregation",
    "KLKind",
    "PolicyLossStats",
    "ValueLossStats",
    "aggregate_loss",
    "dpo_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_loss",
    "kl_penalty",
    "linear_token_logprobs",
    "policy_loss",
    "sft_loss",
    "token_logprobs",
    "value_loss",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3"]

# exp() of a log-ratio beyond this would overflow float32; it is clamped first (as verl does).
_MAX_LOG_RATIO = 20.0


def _mask_like(mask: Tensor, x: Tensor) -> Tensor:
    if mask.shape != x.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and tensor {tuple(x.shape)} differ in shape")
    return mask.to(x.dtype)


def _masked_token_mean(x: Tensor, m: Tensor) -> Tensor:
    return (x * m).sum() / m.sum().clamp(min=1.0)


def aggregate_loss(loss_mat: Tensor, response_mask: Tensor, aggregation: Aggregation = "token-mean") -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over sampled tokens (modes: module docstring)."""
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    m = _mask_like(response_mask, loss_mat)
    if aggregation == "token-mean":
        return _masked_token_mean(loss_mat, m)
    tokens = m.sum(dim=1)
    seq_sum = (loss_mat * m).sum(dim=1)
    if aggregation == "seq-mean-token-mean":
        per_seq = seq_sum / tokens.clamp(min=1.0)
    elif aggregation == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    rows = (tokens > 0).to(loss_mat.dtype)
    return (per_seq * rows).sum() / rows.sum().clamp(min=1.0)


# --------------------------------------------------------------------------------------------
# policy
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of :func:`policy_loss`, detached 0-dim tensors, token-means over sampled tokens.

    ``clip_fraction``: share of tokens whose clipped term is the active one (no gradient), equal to
    ``clip_fraction_low + clip_fraction_high`` for non-zero advantages; ``clip_fraction_low``:
    ``A < 0`` and ``ratio < 1 - clip_low``; ``clip_fraction_high``: ``A > 0`` and
    ``ratio > 1 + clip_high``; ``dual_clip_fraction``: tokens capped by the dual clip;
    ``approx_kl``: ``mean(ratio - 1 - log ratio)`` (k3 estimate of KL(old || new), >= 0);
    ``ratio_mean``: mean importance ratio.
    """

    clip_fraction: Tensor
    clip_fraction_low: Tensor
    clip_fraction_high: Tensor
    dual_clip_fraction: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor

    def as_dict(self) -> dict[str, float]:
        """Plain floats, for logging."""
        return {name: float(getattr(self, name)) for name in self.__dataclass_fields__}


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    aggregation: Aggregation = "token-mean",
    dual_clip: float | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """PPO clipped surrogate with asymmetric clipping (clip-higher, DAPO) and optional dual clip.

    Per sampled token, with ``rho = exp(logp - logp_old)``::

        l = max( -A * rho,  -A * clip(rho, 1 - clip_low, 1 + clip_high) )
        dual clip (c = dual_clip > 1), only where A < 0:   l = min(l, -A * c)

    then aggregated with ``aggregation``. ``old_logprobs`` and ``advantages`` are constants
    (detached). ``clip_high > clip_low`` leaves more room for raising the probability of unlikely
    good tokens (against entropy collapse). The log-ratio is clamped to +-20 before ``exp``.
    """
    if not logprobs.shape == old_logprobs.shape == advantages.shape:
        raise ValueError("logprobs, old_logprobs and advantages must have the same shape")
    if clip_low < 0 or clip_high < 0:
        raise ValueError("clip_low and clip_high must be >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m = _mask_like(response_mask, logprobs)
    adv = advantages.detach().to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(m, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (cap < loss_mat)
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, cap), loss_mat)
    loss = aggregate_loss(loss_mat, response_mask, aggregation)

    with torch.no_grad():
        r = ratio.detach()
        lr = log_ratio.detach()
        stats = PolicyLossStats(
            clip_fraction=_masked_token_mean((clipped.detach() > unclipped.detach()).to(m.dtype), m),
            clip_fraction_low=_masked_token_mean(((adv < 0) & (r < 1.0 - clip_low)).to(m.dtype), m),
            clip_fraction_high=_masked_token_mean(((adv > 0) & (r > 1.0 + clip_high)).to(m.dtype), m),
            dual_clip_fraction=_masked_token_mean(dual_active.to(m.dtype), m),
            approx_kl=_masked_token_mean(r - 1.0 - lr, m),
            ratio_mean=_masked_token_mean(r, m),
        )
    return loss, stats


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[..., labels]``: log-probability of each token, ``[B, T]`` from ``[B, T, V]``.

    Labels outside ``[0, V)`` (e.g. ``-100`` on masked positions) give 0.
    """
    valid = (labels >= 0) & (labels < logits.shape[-1])
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, logp, torch.zeros_like(logp))


ENTROPY_ROWS = 64
"""Rows of `_entropy_of`'s products at a time: a [64, V] product stays in the CPU's cache."""


def _entropy_of(probs: Tensor, log_probs: Tensor) -> Tensor:
    """-sum_v p_v log p_v per row, `ENTROPY_ROWS` rows at a time (no [n, V] temporary), in float32 even under
    autocast: a batched dot product under bf16 autocast copied both [n, V] operands to bf16 first (4x the time,
    the update's largest op on CPU, and off by up to ~0.02 nats), and one [n, V] product at once is 3x slower than
    row chunks (`benchmarks/update_kernels_bench.py`)."""
    entropy = torch.empty(probs.shape[0], dtype=probs.dtype, device=probs.device)
    with torch.autocast(device_type=probs.device.type, enabled=False):
        for start in range(0, probs.shape[0], ENTROPY_ROWS):
            rows = slice(start, start + ENTROPY_ROWS)
            torch.linalg.vecdot(probs[rows], log_probs[rows], out=entropy[rows])
    return entropy.neg_()


class _LinearTokenLogprobs(torch.autograd.Function):
    """The LM head and the log-prob of each label in one op (see :func:`linear_token_logprobs`)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        logits = torch.mm(hidden, weight.t())  # under autocast: the matmul in its dtype
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # softmax statistics in float32 at least
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(1, labels.unsqueeze(1)).squeeze(1) - lse
        log_probs = logits.sub_(lse.unsqueeze(1))  # in place: the logits are not needed again
        if with_entropy:
            probs = log_probs.exp()
            entropy = _entropy_of(probs, log_probs)
        else:
            probs = log_probs.exp_()
            entropy = torch.zeros_like(logp)
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(hidden, weight, labels, probs)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None, None]:
        hidden, weight, labels, probs = ctx.saved_tensors
        # d logp_i / d z_iv = 1[v = y_i] - p_iv
        grad_logits = probs * (-grad_logp).unsqueeze(1)
        grad_logits[torch.arange(labels.shape[0], device=labels.device), labels] += grad_logp
        device_type, enabled, dtype = ctx.autocast
        if not enabled:
            grad_logits = grad_logits.to(weight.dtype)  # half-precision parameters: matmuls in their dtype
        with torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled):
            grad_hidden = torch.mm(grad_logits, weight) if ctx.needs_input_grad[0] else None
            grad_weight = torch.mm(grad_logits.t(), hidden) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def linear_token_logprobs(
    hidden: Tensor, weight: Tensor, labels: Tensor, with_entropy: bool = False
) -> tuple[Tensor, Tensor]:
    """Log-prob of each label under an LM head without bias, and (as a metric, no gradient) the entropy.

    For hidden states ``h`` ``[n, H]``, head weight ``W`` ``[V, H]`` and labels ``y`` ``[n]``::

        z_i = W h_i,   lse_i = log sum_v exp(z_iv),   logp_i = z_{i, y_i} - lse_i
        H_i = - sum_v p_iv log p_iv   with   p_iv = exp(z_iv - lse_i)
        d logp_i / d z_iv = 1[v = y_i] - p_iv

    The same values and gradients as ``log_softmax(h @ W.T).gather(y)``, with fewer passes over the
    ``[n, V]`` logits: it keeps only the softmax ``p`` for the backward pass (where ``log_softmax``
    keeps its output and its backward builds a zero-filled ``[n, V]`` gradient for the gather and
    another for the softmax), and the entropy reuses ``p``. Labels must lie in ``[0, V)``.
    Returns ``(logp, entropy)``, each ``[n]``; the entropy is zeros without ``with_entropy``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, H] and weight [V, H] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [n] for hidden {tuple(hidden.shape)}, got {tuple(labels.shape)}")
    logp, entropy = _LinearTokenLogprobs.apply(hidden, weight, labels, with_entropy)
    return logp, entropy


# --------------------------------------------------------------------------------------------
# KL and entropy
# --------------------------------------------------------------------------------------------


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

    With ``d = logp - ref_logp`` (tokens sampled from ``pi``)::

        k1 = d                        unbiased, high variance, can be negative
        k2 = d^2 / 2                  biased, low variance, >= 0
        k3 = exp(-d) - (-d) - 1       unbiased, low variance, >= 0   ("low_var_kl")

    Unmasked: multiply by the response mask, or use :func:`kl_loss`. As a reward penalty pass it to
    ``reinforce_plus_plus_advantages(kl_per_token=...)`` / ``kl_penalized_rewards``. For k3 the
    log-ratio is clamped to +-20 before ``exp``.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError("logprobs and ref_logprobs must have the same shape")
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        neg = (-d).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    kind: KLKind = "k3",
    aggregation: Aggregation = "token-mean",
) -> Tensor:
    """KL to the reference policy as a loss term: ``aggregate(kl_penalty(logp, ref, kind))``."""
    return aggregate_loss(kl_penalty(logprobs, ref_logprobs.detach(), kind), response_mask, aggregation)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical over the last axis: ``H = logsumexp(z) - sum softmax(z) * z``."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_bonus(logits: Tensor, response_mask: Tensor, aggregation: Aggregation = "token-mean") -> Tensor:
    """Aggregated entropy over sampled tokens; the trainer minimises ``pg_loss - coef * bonus``."""
    return aggregate_loss(entropy_from_logits(logits), response_mask, aggregation)


# --------------------------------------------------------------------------------------------
# value
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueLossStats:
    """Diagnostics of :func:`value_loss` (detached token-means over sampled tokens).

    ``clip_fraction``: share of tokens where the clipped error is the larger (active) one;
    ``value_mean``: mean predicted value; ``explained_variance``: ``1 - Var(R - V) / Var(R)``
    (population variances over sampled tokens; 0 when ``Var(R) = 0``).
    """

    clip_fraction: Tensor
    value_mean: Tensor
    explained_variance: Tensor

    def as_dict(self) -> dict[str, float]:
        """Plain floats, for logging."""
        return {name: float(getattr(self, name)) for name in self.__dataclass_fields__}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range: float | None = 0.2,
    aggregation: Aggregation = "token-mean",
) -> tuple[Tensor, ValueLossStats]:
    """Clipped value loss (PPO2 / CleanRL / verl)::

        v_clip = v_old + clip(v - v_old, -clip_range, clip_range)
        l      = 1/2 * max( (v - R)^2, (v_clip - R)^2 )

    The 1/2 makes the gradient of the unclipped branch ``v - R``. ``clip_range=None`` gives the
    plain ``1/2 (v - R)^2``. ``old_values`` and ``returns`` are constants (detached).
    """
    if not values.shape == old_values.shape == returns.shape:
        raise ValueError("values, old_values and returns must have the same shape")
    m = _mask_like(response_mask, values)
    target = returns.detach().to(values.dtype)
    unclipped = (values - target) ** 2
    if clip_range is None:
        loss_mat = unclipped
        clip_active = torch.zeros_like(m)
    else:
        old = old_values.detach().to(values.dtype)
        v_clip = old + torch.clamp(values - old, -clip_range, clip_range)
        clipped = (v_clip - target) ** 2
        loss_mat = torch.maximum(unclipped, clipped)
        clip_active = (clipped.detach() > unclipped.detach()).to(m.dtype)
    loss = 0.5 * aggregate_loss(loss_mat, response_mask, aggregation)
    with torch.no_grad():
        err = target - values.detach()
        var_r = _masked_token_mean((target - _masked_token_mean(target, m)) ** 2, m)
        var_e = _masked_token_mean((err - _masked_token_mean(err, m)) ** 2, m)
        stats = ValueLossStats(
            clip_fraction=_masked_token_mean(clip_active, m),
            value_mean=_masked_token_mean(values.detach(), m),
            explained_variance=torch.where(var_r > 0, 1.0 - var_e / var_r.clamp(min=1e-12), torch.zeros_like(var_r)),
        )
    return loss, stats


# --------------------------------------------------------------------------------------------
# supervised / preference
# --------------------------------------------------------------------------------------------


def sft_loss(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tensor:
    """Token-mean cross-entropy over masked-in tokens (SFT on expert demos, rejection sampling FT).

    ``L = - sum_{b,t} m_{b,t} log softmax(logits_{b,t})[labels_{b,t}] / sum_{b,t} m_{b,t}``

    ``logits`` ``[B, T, V]`` aligned with ``labels`` ``[B, T]`` (already shifted); labels under a
    zero mask are ignored (may be ``-100``).
    """
    if logits.shape[:-1] != labels.shape or labels.shape != loss_mask.shape:
        raise ValueError("logits must be [B, T, V] and labels, loss_mask [B, T]")
    nll = -token_logprobs(logits, labels)
    return _masked_token_mean(nll, loss_mask.to(nll.dtype))


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO loss (Rafailov et al. 2023) on sequence log-probs ``[N]``; returns (loss, r_chosen, r_rejected).

    ``h = (logp_c - ref_c) - (logp_r - ref_r)``;
    ``L = mean( -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) )`` (``eps`` = label
    smoothing, conservative DPO; 0 gives plain DPO). The implicit rewards
    ``beta (logp - ref)`` are returned detached.
    """
    chosen = policy_chosen_logps - ref_chosen_logps.detach()
    rejected = policy_rejected_logps - ref_rejected_logps.detach()
    logits = beta * (chosen - rejected)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses.mean(), beta * chosen.detach(), beta * rejected.detach()
