"""Sampling parameters and the token sampler of the inference engine.

Sampling: `temperature` 0 is greedy; otherwise the logits are divided by the temperature, nucleus-filtered
with `top_p`, and sampled with a per-sequence `torch.Generator` (seeded from the request's `seed` and the
sample index, so a seeded request is reproducible when its batch composition is the same). The nucleus is
looked for among each row's most likely tokens (a top-k) before any whole vocabulary is sorted:
`benchmarks/sampler_bench.py`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentgym.inference.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0
    """Also return the `top_logprobs` most likely tokens (raw model logprobs) at each position."""


def _sample_seed(seed: int | None, index: int) -> int:
    """The generator seed of sample `index`: derived from the request seed, or random when it has none."""
    if seed is None:
        return random.SystemRandom().getrandbits(63)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted to the row's top-p nucleus.

    Inverse-CDF sampling with one uniform draw from each row's own generator: the distribution of
    `torch.multinomial`, at a fraction of the cost of one multinomial call per row. Rows with top-p 1
    walk the CDF in vocabulary order; the others walk their nucleus, most likely token first.
    """
    scaled = logits
    if any(t != 1.0 for t in temperatures):  # x / 1 == x: skip a full-vocabulary pass in the common case
        temps = torch.tensor(temperatures, device=logits.device, dtype=logits.dtype).unsqueeze(1)
        scaled = logits / temps
    uniforms = _uniforms(generators, logits.device)
    top_p = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    truncated = top_p < 1
    if not bool(truncated.any()):
        return _inverse_cdf(torch.softmax(scaled, dim=-1), uniforms)
    if bool(truncated.all()):
        return _sample_nucleus(scaled, top_p, uniforms)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    whole, rows = torch.nonzero(~truncated).flatten(), torch.nonzero(truncated).flatten()
    tokens[whole] = _inverse_cdf(torch.softmax(scaled[whole], dim=-1), uniforms[whole])
    tokens[rows] = _sample_nucleus(scaled[rows], top_p[rows], uniforms[rows])
    return tokens


LOG2_E = 1.0 / math.log(2.0)
"""log2(e): exp(x) = 2^(x log2 e)."""


@dataclass(frozen=True)
class SliceWeights:
    """The CDF weights of `choose_tokens`, computed with the logits one vocabulary slice at a time (by the thread
    that computed the slice's logits, while they are in its cache: `LeanDecoder`'s sliced LM head), each slice
    against its own peak: for column j of slice s,

        w_j = exp(l_j - p_s),   p_s = max of the row's logits in slice s,

    and the sum of w over each block of `CDF_BLOCK` columns (every slice is a whole number of blocks).
    `choose_tokens` rescales the block sums by exp(p_s - max_s p_s), and the chosen block's weights likewise: the
    CDF of exp(l - max l), up to float rounding."""

    weights: torch.Tensor
    """[rows, vocab]."""
    peaks: torch.Tensor
    """[rows, slices]."""
    block_sums: torch.Tensor
    """[rows, vocab / CDF_BLOCK]."""
    slice_width: int
    """Columns of each slice, a multiple of `CDF_BLOCK`."""


def walks_the_cdf(temperatures: Sequence[float], top_ps: Sequence[float]) -> bool:
    """Whether every row samples at temperature 1 without a nucleus (a rollout's usual request): then
    `choose_tokens` walks the CDF of exp(l - max l) directly, and can take a sliced head's `SliceWeights`."""
    return all(t == 1.0 and p >= 1.0 for t, p in zip(temperatures, top_ps, strict=True))


def _shifted_exp(x: torch.Tensor, peak: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """exp(x - peak), as 2^((x - peak) log2 e): torch's vectorised exp2 takes ~half of exp's time on CPU (AVX2: 32
    x 49,152 logits 1.84 -> 1.22 ms with the multiplication); the values differ by rounding only (relative 2e-6 at
    most)."""
    return torch.sub(x, peak, out=out).mul_(LOG2_E).exp2_()


def fill_slice_weights(logits: torch.Tensor, weights: torch.Tensor, block_sums: torch.Tensor) -> torch.Tensor:
    """Write one slice's weights exp(l - p) into `weights` and their block sums into `block_sums` (views of a
    `SliceWeights`' tensors); return the slice's peaks p `[rows]`."""
    peak = logits.amax(dim=-1, keepdim=True)
    _shifted_exp(logits, peak, out=weights)
    torch.sum(weights.unflatten(-1, (-1, CDF_BLOCK)), dim=-1, out=block_sums)
    return peak.squeeze(1)


def choose_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
    slices: SliceWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's next token (temperature 0: the argmax; else drawn as `sample_tokens` draws), its raw logprob
    log softmax(logits)[token] and the row's log-normalizer (any token's logprob is its logit minus it), without a
    [rows, vocab] log-softmax:

        m = max_j l_j,   w_j = exp(l_j - m) = 2^((l_j - m) log2 e),   logprob(token) = l_token - (m + log sum_j w_j)

    w is softmax(l) up to each row's factor, so when every row samples at temperature 1 without a nucleus (a
    rollout's usual request) its CDF is walked directly: one exp pass and one summing pass over the logits (the
    block sums of the two-level inverse CDF give the normalizer too) instead of a log-softmax, a softmax and a
    cumsum (`benchmarks/sampler_bench.py`). Given the logits' `slices` (`SliceWeights`), such rows use their
    weights instead of making them."""
    walks = walks_the_cdf(temperatures, top_ps)
    if slices is not None and walks:
        top = slices.peaks.amax(dim=-1, keepdim=True)
        factors = _shifted_exp(slices.peaks, top)  # exp(p_s - max p): each slice's rescaling
        blocks = slices.block_sums * factors.repeat_interleave(slices.slice_width // CDF_BLOCK, dim=1)
        uniforms = _uniforms(generators, logits.device)
        tokens, totals = _choose_in_blocks(slices.weights, blocks, uniforms, factors, slices.slice_width)
        log_normalizer = top.squeeze(1) + totals.log()
        return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - log_normalizer, log_normalizer
    peak = logits.amax(dim=-1, keepdim=True)
    weights = _shifted_exp(logits, peak)
    if walks:
        tokens, totals = _inverse_cdf_and_totals(weights, _uniforms(generators, logits.device))
    elif all(t > 0 for t in temperatures):  # no greedy row: no argmax, no row gather / scatter
        tokens, totals = sample_tokens(logits, temperatures, top_ps, generators), weights.sum(dim=-1)
    else:
        totals = weights.sum(dim=-1)
        tokens = torch.argmax(logits, dim=-1)
        rows = [row for row, temperature in enumerate(temperatures) if temperature > 0]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            tokens[index] = sample_tokens(
                logits.index_select(0, index),
                [temperatures[row] for row in rows],
                [top_ps[row] for row in rows],
                [generators[row] for row in rows],
            )
    log_normalizer = peak.squeeze(1) + totals.log()
    return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - log_normalizer, log_normalizer


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform draw from each row's own generator (the global one where a row has none)."""
    return torch.stack([torch.rand((), generator=g, device=device) for g in generators])


CDF_BLOCK = 256
"""Columns per block of the two-level inverse CDF (`_inverse_cdf_and_totals`)."""


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the column where the running sum of ``probs`` first exceeds ``uniform`` x the row's total."""
    return _inverse_cdf_and_totals(probs, uniforms)[0]


def _inverse_cdf_and_totals(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the column where the running sum of ``weights`` (>= 0) first exceeds u = ``uniform`` x the row's
    total; and the totals. In two levels, so that no running sum is taken over a whole vocabulary (a sequential
    pass, a third of a decode step's sampling at 49k tokens):

        S_b = sum of block b's weights (blocks of `CDF_BLOCK` columns),  C_b = S_0 + ... + S_b,
        b* = the first block with C_b > u,  then within b*: the first column whose running sum exceeds u - C_(b*-1).

    The same column as one running sum over the row, up to float rounding at a boundary. The chosen column always
    has a weight > 0: within the block its running sum steps over the target, and a target the block's own sum
    falls short of by rounding takes the block's last column with a weight > 0 instead of one past it.
    """
    rows, columns = weights.shape
    if columns <= CDF_BLOCK:  # a nucleus' candidates: one block
        cdf = weights.cumsum(dim=-1)
        targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
        return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=columns - 1), cdf[:, -1]
    width = CDF_BLOCK
    whole = columns // width * width
    blocks = weights[:, :whole].reshape(rows, -1, width).sum(dim=-1)
    if whole < columns:
        blocks = torch.cat((blocks, weights[:, whole:].sum(dim=-1, keepdim=True)), dim=1)
    return _choose_in_blocks(weights, blocks, uniforms)


def _choose_in_blocks(
    weights: torch.Tensor,
    blocks: torch.Tensor,
    uniforms: torch.Tensor,
    slice_factors: torch.Tensor | None = None,
    slice_width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_inverse_cdf_and_totals` from the block sums `blocks` of `weights` on; with `slice_factors` `[rows,
    slices]`, the weights of the columns in slice s (`slice_width` columns each) are taken times its factor (the
    block sums already are: `SliceWeights`)."""
    columns, width = int(weights.shape[1]), CDF_BLOCK
    cumulative = blocks.cumsum(dim=-1)
    totals = cumulative[:, -1]
    targets = (uniforms.to(weights.dtype) * totals).unsqueeze(1)
    block = torch.searchsorted(cumulative, targets, right=True).clamp(max=blocks.shape[1] - 1)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)), 0.0)
    offsets = torch.arange(width, device=weights.device)
    index = block * width + offsets  # [rows, width]: the chosen block's columns (past the last one in a short block)
    inside = index < columns
    inner = torch.where(inside, weights.gather(1, index.clamp(max=columns - 1)), 0.0)
    if slice_factors is not None:  # the chosen block's slice's rescaling (a block lies in one slice)
        inner = inner * slice_factors.gather(1, block * width // slice_width)
    column = torch.searchsorted(inner.cumsum(dim=-1), targets - before, right=True)
    last_positive = width - 1 - (inner > 0).flip(-1).to(torch.int8).argmax(dim=-1, keepdim=True)
    return (block * width + torch.minimum(column, last_positive)).squeeze(1), totals


NUCLEUS_WIDTHS = (64, 1024)
"""Candidates a row's nucleus is looked for among (`torch.topk`), in turn, before its whole vocabulary is sorted."""


def _sample_nucleus(
    scaled: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor, widths: Sequence[int] = NUCLEUS_WIDTHS
) -> torch.Tensor:
    """One token per row from its top-p nucleus, looked for among the first of ``widths`` candidates, the rows whose
    nucleus is wider among the next, and so on; past the last, the whole vocabulary is sorted. A policy's nucleus
    is a few tokens, and a top-k costs a fraction of a full sort at every decode step."""
    vocabulary = scaled.shape[-1]
    width = min(widths[0], vocabulary) if widths else vocabulary
    probs, ids, inside = _nucleus(scaled, top_p, width)
    tokens = ids.gather(1, _inverse_cdf(probs, uniforms).unsqueeze(1)).squeeze(1)
    if bool(inside.all()):
        return tokens
    rows = torch.nonzero(~inside).flatten()
    # Every token past the candidates is at most as likely as the last one (all candidates are kept in these rows):
    # a wider set of candidates that cannot reach top_p even so is not worth a top-k.
    held, smallest = probs[rows].sum(dim=-1), probs[rows, -1]
    wider = [w for w in widths[1:] if bool((held + (w - width) * smallest >= top_p[rows]).any())]
    tokens[rows] = _sample_nucleus(scaled[rows], top_p[rows], uniforms[rows], wider)
    return tokens


def _nucleus(scaled: torch.Tensor, top_p: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Among each row's ``width`` most likely tokens: its top-p nucleus and whether the nucleus lies inside them.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``. Returns the
    candidates' probabilities (most likely first, 0 past the nucleus), their token ids, and per row whether the
    candidates hold ``top_p`` of the mass: then the nucleus is inside them, exactly.
    """
    if width >= scaled.shape[-1]:
        top_logits, ids = torch.sort(scaled, dim=-1, descending=True)
    else:
        top_logits, ids = scaled.topk(width, dim=-1)
    probs = torch.exp(top_logits - torch.logsumexp(scaled, dim=-1, keepdim=True))
    through = probs.cumsum(dim=-1)
    keep = through - probs < top_p.unsqueeze(1)  # the mass of the strictly more likely tokens is short of top_p
    keep[:, 0] = True
    inside = (through[:, -1] >= top_p) | (width >= scaled.shape[-1])
    return probs * keep, ids, inside


def check_request(
    prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int, max_batch_size: int
) -> None:
    """Raise `InvalidRequestError` when the request cannot be served by a model of `vocab_size` tokens and
    `max_model_len` positions with batches of `max_batch_size` sequences."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
    if params.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be >= 1")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens"
        )
    if not 1 <= params.n <= max_batch_size:
        raise InvalidRequestError(f"n must be between 1 and {max_batch_size} (the max batch size)")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise InvalidRequestError("temperature must be a finite number >= 0")
    if not 0 < params.top_p <= 1:
        raise InvalidRequestError("top_p must be in (0, 1]")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise InvalidRequestError(f"stop_token_ids out of the vocabulary: {bad_stop[:5]}")
    if any(not s for s in params.stop):
        raise InvalidRequestError("stop strings must not be empty")
