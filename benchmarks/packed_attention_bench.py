"""Update time of `RLTrainer.train_step` with ``sdpa_packed`` attention against sdpa with a dense row mask.

The batch is the BabyAI-shaped GRPO step of ``shared_prompt_bench.py`` (``--groups`` groups of
``--group-size`` samples sharing a ~380-token prompt, 1-5 turns of ~30 action and ~60 observation
tokens), packed with shared prompts into rows of ``--micro-batch-tokens``, ``--mini-batch``
trajectories per optimiser step as in the learning check. With the dense mask, every row costs
``O(row^2)`` attention; ``sdpa_packed`` (`agentgym.trainer.packed_attention`) attends span by span.

Both trainers start from the same weights and train on the same batches, alternating, ``--repeats``
times each after one warm-up step each; printed: median update seconds and the ratio, and how far
the two updates' gradient norms drift apart (the same maths in another order).

Usage: python benchmarks/packed_attention_bench.py [--groups 4] [--group-size 8] [--repeats 5]
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

from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.packed_attention import PACKED_ATTENTION

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_prompt_bench import (
    babyai_shaped_batch,
    check_update_bench_args,
    scratch_dir,
    update_bench_parser,
    update_bench_trainer,
)

ATTENTION_KINDS = ("sdpa", PACKED_ATTENTION)


def main(argv: Sequence[str] | None = None) -> int:
    parser = update_bench_parser(__doc__)
    args = parser.parse_args(argv)
    check_update_bench_args(parser, args)

    work = scratch_dir("packed-attention-bench-")
    # With the config's KL (a reference forward in both settings), as this bench always measured.
    trainers = {
        kind: update_bench_trainer(args, work / kind, attn_implementation=kind, kl_coef=RLTrainerConfig.kl_coef)
        for kind in ATTENTION_KINDS
    }
    model_config: Any = trainers["sdpa"].policy.config
    print(f"# packed-attention update bench, {args.model}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))

    seconds: dict[str, list[float]] = {kind: [] for kind in ATTENTION_KINDS}
    grad_norms: dict[str, list[float]] = {kind: [] for kind in ATTENTION_KINDS}
    for repeat in range(args.repeats + 1):
        batch = babyai_shaped_batch(args.groups, args.group_size, int(model_config.vocab_size), args.seed + repeat)
        for t in batch:  # fresh ids each round: the trainers drop trajectories they have seen
            t.trajectory_id = f"{repeat}/{t.trajectory_id}"
        for kind in ATTENTION_KINDS:
            started = time.perf_counter()
            metrics = trainers[kind].train_step(batch)
            if repeat > 0:  # the first round warms up both
                seconds[kind].append(time.perf_counter() - started)
            grad_norms[kind].append(metrics.train["grad_norm"])
    tokens = sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in batch)
    print(f"last batch: {len(batch)} trajectories, {tokens} tokens before prompt sharing")
    for kind, label in (("sdpa", "sdpa, dense row mask"), (PACKED_ATTENTION, f"{PACKED_ATTENTION}, span by span")):
        print(
            f"{label:>26}: update {statistics.median(seconds[kind]):.2f} s median of {args.repeats}"
            f" (min {min(seconds[kind]):.2f})"
        )
    ratio = statistics.median(seconds["sdpa"]) / statistics.median(seconds[PACKED_ATTENTION])
    print(f"speed-up: {ratio:.2f}x")
    gap = max(
        abs(a - b) / max(abs(a), 1e-12) for a, b in zip(grad_norms["sdpa"], grad_norms[PACKED_ATTENTION], strict=True)
    )
    print(f"same update: gradient norms of the {args.repeats + 1} steps agree within {gap:.1e} (relative)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
