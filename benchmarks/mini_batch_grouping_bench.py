"""Update time of a BabyAI GRPO step with mini-batches of whole groups, against mini-batches shuffled across groups.

The learning check (``grpo_learning_bench.py``) makes 4 optimiser steps per step: 4 groups of 8,
mini-batches of 8. Shuffled across groups, a mini-batch draws ~2 samples from each of ~4 groups
and packing forwards ~4 prompts of ~380 tokens for ~8 responses of ~150; with whole groups
(``mini_batches_by_group``, the default) it forwards one. The batch is the shared-prompt bench's
(``shared_prompt_bench.babyai_shaped_batch``: random token ids in the learning check's shape).

Both settings train from the same weights on the same batches, alternating, ``--repeats`` times each
after one warm-up step each; printed: median update seconds, tokens forwarded, and the ratio. The
updates differ (other samples share an optimiser step), so only the cost is compared here; the
learning check measures what the grouping does to learning.

Usage: python benchmarks/mini_batch_grouping_bench.py [--groups 4] [--group-size 8] [--mini-batch 8] [--repeats 5]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared-prompt bench next to this script
from shared_prompt_bench import (
    babyai_shaped_batch,
    check_update_bench_args,
    scratch_dir,
    update_bench_parser,
    update_bench_trainer,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = update_bench_parser(__doc__)
    args = parser.parse_args(argv)
    check_update_bench_args(parser, args)

    work = scratch_dir("mini-batch-grouping-bench-")
    trainers = {}
    for by_group in (False, True):
        output_dir = work / ("by-group" if by_group else "shuffled")
        trainers[by_group] = update_bench_trainer(args, output_dir, mini_batches_by_group=by_group)
    model_config: Any = trainers[False].policy.config
    vocab = int(model_config.vocab_size)
    print(f"# mini-batch grouping bench, {args.model}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))
    print(f"update precision: {'bf16 autocast' if trainers[True].autocast_dtype else 'float32'}")

    seconds: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(args.repeats + 1):
        batch = babyai_shaped_batch(args.groups, args.group_size, vocab, args.seed + repeat)
        for t in batch:  # fresh ids each round: the trainers drop trajectories they have seen
            t.trajectory_id = f"{repeat}/{t.trajectory_id}"
        for by_group in (False, True):
            started = time.perf_counter()
            metrics = trainers[by_group].train_step(batch)
            elapsed = time.perf_counter() - started
            if repeat > 0:  # the first round warms up both
                seconds[by_group].append(elapsed)
                tokens[by_group].append(metrics.train["tokens"])
    sampled = sum(sum(t.loss_mask) for t in batch)
    for by_group, label in ((False, "shuffled across groups"), (True, "whole groups")):
        print(
            f"{label:>22}: update {statistics.median(seconds[by_group]):.2f} s median of {args.repeats}"
            f" (min {min(seconds[by_group]):.2f}), {statistics.mean(tokens[by_group]):.0f} tokens forwarded"
            f" on average, {sampled} sampled in the last batch"
        )
    ratio = statistics.median(seconds[False]) / statistics.median(seconds[True])
    share = sum(tokens[True]) / sum(tokens[False])
    print(f"speed-up: {ratio:.2f}x; tokens forwarded: {share:.2f} of the shuffled mini-batches'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
