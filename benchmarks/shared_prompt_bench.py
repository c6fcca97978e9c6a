"""Update time of `RLTrainer.train_step` with a group's shared prompt forwarded once, against a copy per sample.

The batch has the shape of a BabyAI GRPO step of the learning check (``grpo_learning_bench.py``):
``--groups`` groups of ``--group-size`` samples, each group one prompt of ~380 tokens (system prompt,
instructions and first observation), responses of 1-5 turns of ~30 action tokens and ~60 observation
tokens. Random token ids on the tiny model (or ``--model``); the update is the same either way (the
sums run in another order), which is checked here too.

Both settings train from the same weights on the same batch, alternating, ``--repeats`` times each
after one warm-up step each; printed: median update seconds, tokens forwarded, and the ratio.

Usage: python benchmarks/shared_prompt_bench.py [--groups 4] [--group-size 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentgym.proto import rl_pb2
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.trainer import RLTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the GPU bench next to this script makes the batch
from trainer_gpu_bench import Profile, synthetic_batch

BABYAI_PROFILE_PER_GROUP = {"prompt": (340, 420), "turns": (1, 5), "action": (20, 36), "observation": (40, 90)}


def babyai_shaped_batch(groups: int, group_size: int, vocab: int, seed: int) -> list[rl_pb2.Trajectory]:
    """``groups`` x ``group_size`` trajectories; the samples of a group start from its first sample's prompt."""
    profile = Profile(groups * group_size, **BABYAI_PROFILE_PER_GROUP)
    batch = synthetic_batch(profile, vocab, seed, group_size)
    prompts = {t.group_id: list(t.prompt_token_ids) for t in reversed(batch)}
    for t in batch:
        del t.prompt_token_ids[:]
        t.prompt_token_ids.extend(prompts[t.group_id])
    return batch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048, help="as in the learning check")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.groups < 1 or args.group_size < 1 or args.repeats < 1:
        parser.error("--groups, --group-size and --repeats must be >= 1")

    work = Path(tempfile.mkdtemp(prefix="shared-prompt-bench-"))
    trainers = {}
    for share in (False, True):
        config = RLTrainerConfig(
            model=args.model,
            output_dir=work / ("shared" if share else "separate"),
            algorithm="grpo",
            group_size=args.group_size,
            mini_batch_size=args.groups * args.group_size,
            learning_rate=1e-5,
            kl_coef=0.0,
            micro_batch_tokens=args.micro_batch_tokens,
            share_prompts=share,
            bf16=args.bf16,
            tensorboard=False,
            otel_metrics=False,
            seed=args.seed,
        )
        trainers[share] = RLTrainer(config, write_metrics=False)
    model_config: Any = trainers[False].policy.config
    vocab = int(model_config.vocab_size)
    print(f"# shared-prompt update bench, {args.model}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))

    seconds: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, float] = {}
    grad_norms: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(args.repeats + 1):
        batch = babyai_shaped_batch(args.groups, args.group_size, vocab, args.seed + repeat)
        for t in batch:  # fresh ids each round: the trainers drop trajectories they have seen
            t.trajectory_id = f"{repeat}/{t.trajectory_id}"
        for share in (False, True):
            started = time.perf_counter()
            metrics = trainers[share].train_step(batch)
            elapsed = time.perf_counter() - started
            if repeat > 0:  # the first round warms up both
                seconds[share].append(elapsed)
            tokens[share] = metrics.train["tokens"]
            grad_norms[share].append(metrics.train["grad_norm"])
    sampled = sum(sum(t.loss_mask) for t in batch)
    for share, label in ((False, "a prompt copy per sample"), (True, "shared prompts")):
        print(
            f"{label:>26}: update {statistics.median(seconds[share]):.2f} s median of {args.repeats}"
            f" (min {min(seconds[share]):.2f}), {tokens[share]:.0f} tokens forwarded, {sampled} sampled"
        )
    ratio = statistics.median(seconds[False]) / statistics.median(seconds[True])
    print(f"speed-up: {ratio:.2f}x; tokens forwarded: {tokens[True] / tokens[False]:.2f} of the copies'")
    gap = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(grad_norms[False], grad_norms[True], strict=True))
    print(f"same update: gradient norms of the {args.repeats + 1} steps agree within {gap:.1e} (relative)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
