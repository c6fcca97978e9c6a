"""A decode step's attention with shared prompt prefixes read once (`decoder.cascade_attention`) against each row's
whole cache (`decoder.shared_attention`, the engine's attention without them), at the quickstart's shape.

The batch is a GRPO rollout step's: `--tasks` tasks x `--samples` samples, each task's rows sharing a prompt of
`--prefix` tokens, each row then `--own` columns of its own (earlier turns' completions and observations; one
figure per value), the tiny model's attention (4 heads of 64, float32 keys and values, as the bf16 engine caches
them on a CPU whose bf16 attention kernel is the slower) unless `--heads`/`--kv-heads`/`--head-dim` say otherwise.
`--layers` layers' caches are attended in turn, as a forward pass does, after a pass over a buffer larger than the
CPU's caches, so that each layer's keys come from memory as they do between layers of a step. The two are timed
alternately, `--repeats` times each, with one thread and with a `ForwardHelper` beside it (the engine's setting on 2
cores); printed: median milliseconds a layer and the ratio whole / cascade, and the largest difference of the
outputs (float rounding only). Its figures in the services/inference README's prefix-caching section.

Usage: python benchmarks/cascade_attention_bench.py [--tasks 4] [--samples 8] [--prefix 380] [--own 20,120,220,420]
       [--layers 4] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from agentgym.inference.decoder import ForwardHelper, PrefixSegment, SharedPrefixes, cascade_attention, shared_attention


def median_ms(fn: Callable[[int], object], layers: int, flush: torch.Tensor) -> float:
    """One timing: every layer attended once after the caches are flushed; milliseconds a layer."""
    flush.sum()
    start = time.perf_counter()
    for layer in range(layers):
        fn(layer)
    return (time.perf_counter() - start) * 1e3 / layers


Caches = list[tuple[torch.Tensor, torch.Tensor]]


def whole_rows(
    q: torch.Tensor, caches: Caches, allowed: torch.Tensor, scale: float, helper: ForwardHelper | None, layer: int
) -> torch.Tensor:
    return shared_attention(q, *caches[layer], allowed, scale, helper)


def read_once(
    q: torch.Tensor,
    caches: Caches,
    shared: SharedPrefixes,
    window: torch.Tensor,
    scale: float,
    helper: ForwardHelper | None,
    layer: int,
) -> torch.Tensor:
    return cascade_attention(q, *caches[layer], shared, layer, window, None, scale, helper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=380)
    parser.add_argument("--own", default="20,120,220,420")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--flush-mb", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = args.tasks * args.samples
    flush = torch.ones(args.flush_mb * (1 << 20) // 4)
    scale = args.head_dim**-0.5
    helper = ForwardHelper()
    load = os.getloadavg()[0]
    print(
        f"# cascade attention bench: {args.tasks} tasks x {args.samples} samples, a {args.prefix}-token shared "
        f"prompt, {args.heads}/{args.kv_heads} heads of {args.head_dim}, {args.layers} layers; load {load:.1f}"
    )
    print(f"{'own cols':>8} {'threads':>8} {'whole ms':>9} {'cascade ms':>11} {'ratio':>6} {'max diff':>9}")
    generator = torch.Generator().manual_seed(0)
    try:
        for own in (int(value) for value in args.own.split(",")):
            columns = args.prefix + own
            caches = []
            for _ in range(args.layers):
                keys = torch.randn(rows, args.kv_heads, columns, args.head_dim, generator=generator)
                values = torch.randn(rows, args.kv_heads, columns, args.head_dim, generator=generator)
                for task in range(args.tasks):  # a task's rows hold the same prompt keys and values
                    first = task * args.samples
                    keys[first : first + args.samples, :, : args.prefix] = keys[first, :, : args.prefix]
                    values[first : first + args.samples, :, : args.prefix] = values[first, :, : args.prefix]
                caches.append((keys, values))
            q = torch.randn(rows, args.heads, 1, args.head_dim, generator=generator)
            mask = torch.ones(rows, columns, dtype=torch.long)
            segments = [
                PrefixSegment(
                    list(range(task * args.samples, (task + 1) * args.samples)), task * args.samples, 0, args.prefix
                )
                for task in range(args.tasks)
            ]
            shared = SharedPrefixes(segments, torch.full((rows,), args.prefix), args.prefix, mask)
            window = shared.window_mask(mask, torch.float32)
            allowed = mask.bool()[:, None, None, :]
            for threads, pair in (("1", None), ("1+helper", helper)):
                whole = partial(whole_rows, q, caches, allowed, scale, pair)
                cascade = partial(read_once, q, caches, shared, window, scale, pair)
                difference = (whole(0) - cascade(0)).abs().max().item()
                for layer in range(args.layers):  # every layer's prefix copy made, as after a step
                    cascade(layer)
                times: dict[str, list[float]] = {"whole": [], "cascade": []}
                for _ in range(args.repeats):
                    times["whole"].append(median_ms(whole, args.layers, flush))
                    times["cascade"].append(median_ms(cascade, args.layers, flush))
                plain, once = statistics.median(times["whole"]), statistics.median(times["cascade"])
                print(
                    f"{own:>8} {threads:>8} {plain:>9.3f} {once:>11.3f} {plain / once:>5.2f}x {difference:>9.1e}",
                    flush=True,
                )
    finally:
        helper.close()
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
