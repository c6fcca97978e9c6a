"""Sampler benchmark: the cost of top-p at each decode step, nucleus among the top candidates vs a full sort.

`agentgym.inference.engine.sample_tokens` draws one token per row from the tempered nucleus. It used to sort
each row's whole vocabulary at every decode step, mask the tokens past the nucleus and walk the masked CDF
over the whole vocabulary. It now looks for the nucleus among each row's most likely
tokens (`torch.topk`, 64 then 1024) and walks only those; it sorts a whole vocabulary only when a
nucleus is wider still.
Measured in one run, on logits as peaked as a warmed-up policy's (a nucleus of a few tokens) and as flat as
a random model's (every row sorted whole), against:
  - top-p 1 (no nucleus: the floor), and
  - the previous sampler, kept here as `full_sort_sampler` (the baseline).

Then a decode step's whole choice at temperature 1 and top-p 1 (a rollout's request): the token and its raw
logprob, as the engine took them before (a [rows, vocab] log-softmax, then a softmax and one running sum over the
vocabulary), with one exp pass and one running sum (`one_running_sum_choice`: `choose_tokens` as it was) and as it
takes them now (`choose_tokens`: one exp pass, and a two-level inverse CDF whose block sums give the normalizer).

Usage: python benchmarks/sampler_bench.py [--rows 32] [--vocabulary 49152] [--top-p 0.95] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from agentgym.allocator import retain_freed_memory
from agentgym.inference.engine import _nucleus, sample_tokens
from agentgym.inference.sampling import choose_tokens


def per_call_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of one call, in milliseconds (after a few warm-up calls)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000.0 * statistics.median(times)


def full_sort_sampler(logits: torch.Tensor, top_p: float, generators: list[torch.Generator]) -> torch.Tensor:
    """The previous top-p sampler (temperature 1): sort every row whole, mask past the nucleus, walk the CDF."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    drop_sorted[:, 0] = False
    masked = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    cdf = torch.softmax(masked, dim=-1).cumsum_(dim=-1)
    uniforms = torch.stack([torch.rand((), generator=g) for g in generators])
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)


def measure(logits: torch.Tensor, top_p: float, repeats: int) -> tuple[float, float, float]:
    """Milliseconds per call: top-p 1 (the floor), the previous sampler (the baseline), the sampler now."""
    rows = logits.shape[0]
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    floor = per_call_ms(lambda: sample_tokens(logits, [1.0] * rows, [1.0] * rows, generators), repeats)
    old = per_call_ms(lambda: full_sort_sampler(logits, top_p, generators), repeats)
    new = per_call_ms(lambda: sample_tokens(logits, [1.0] * rows, [top_p] * rows, generators), repeats)
    return floor, old, new


def _one_running_sum(weights: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The inverse CDF as one running sum over each row's whole vocabulary (the sampler's before this round)."""
    cdf = weights.cumsum(dim=-1)
    uniforms = torch.stack([torch.rand((), generator=g) for g in generators])
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=weights.shape[-1] - 1)


def log_softmax_then_sample(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The engine's choice before `choose_tokens`: the chosen tokens' logprobs gathered from a full log-softmax."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = _one_running_sum(torch.softmax(logits, dim=-1), generators)
    return logprobs.gather(1, tokens[:, None])[:, 0]


def one_running_sum_choice(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """`choose_tokens` before its two-level inverse CDF: one exp pass, a sum and a running sum over the vocabulary."""
    peak = logits.amax(dim=-1, keepdim=True)
    weights = torch.sub(logits, peak).exp_()
    log_normalizer = peak.squeeze(1) + weights.sum(dim=-1).log()
    tokens = _one_running_sum(weights, generators)
    return logits.gather(1, tokens[:, None]).squeeze(1) - log_normalizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="sequences in the decode batch")
    parser.add_argument("--vocabulary", type=int, default=49152, help="builtin:tiny's (SmolLM2's) vocabulary")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    retain_freed_memory()  # as the engine does: each step's [rows, vocab] buffers reuse freed ones
    generator = torch.Generator().manual_seed(0)
    print(f"# top-p {args.top_p}, {args.rows} rows x {args.vocabulary} tokens, {torch.get_num_threads()} threads")
    cases = (("peaked (a warmed-up policy)", 12.0), ("less sure", 5.0), ("flat (a random model)", 0.05))
    for name, scale in cases:
        logits = torch.randn(args.rows, args.vocabulary, generator=generator) * scale
        probs, _, _ = _nucleus(logits, torch.full((args.rows,), args.top_p), args.vocabulary)
        floor, old, new = measure(logits, args.top_p, args.repeats)
        print(f"{name}: nucleus of {(probs > 0).sum(dim=1).float().mean():.0f} tokens on average")
        print(f"  top-p 1 (no nucleus)          {floor:7.2f} ms per decode step")
        print(f"  top-p, full sort (before)     {old:7.2f} ms")
        print(f"  top-p, top candidates (now)   {new:7.2f} ms  -> {old / new:.1f}x the speed of the full sort")
    logits = torch.randn(args.rows, args.vocabulary, generator=generator) * 5.0
    generators = [torch.Generator().manual_seed(i) for i in range(args.rows)]
    rows = args.rows
    before, running_sum, now = [], [], []
    for _ in range(3):  # interleaved
        before.append(per_call_ms(lambda: log_softmax_then_sample(logits, generators), args.repeats))
        running_sum.append(per_call_ms(lambda: one_running_sum_choice(logits, generators), args.repeats))
        now.append(per_call_ms(lambda: choose_tokens(logits, [1.0] * rows, [1.0] * rows, generators), args.repeats))
    old_ms, sum_ms, new_ms = statistics.median(before), statistics.median(running_sum), statistics.median(now)
    print("token and logprob at temperature 1, top-p 1 (medians of 3 interleaved rounds):")
    print(f"  log-softmax + sampler (before) {old_ms:7.2f} ms per decode step")
    print(f"  exp pass + one running sum     {sum_ms:7.2f} ms  -> {old_ms / sum_ms:.1f}x the speed of before")
    print(
        f"  choose_tokens (now)            {new_ms:7.2f} ms  -> {old_ms / new_ms:.1f}x the speed of before, "
        f"{sum_ms / new_ms:.1f}x that of one running sum"
    )


if __name__ == "__main__":
    main()
