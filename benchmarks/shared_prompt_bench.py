"""Update time of `RLTrainer.train_step` with prompts forwarded once, against a copy per sample.

The batch has the shape of a BabyAI GRPO step of the learning check (``grpo_learning_bench.py``):
``--groups`` groups of ``--group-size`` samples, each group one prompt of ~380 tokens (system prompt,
instructions and first observation) whose first ``--common-prefix`` (256, as BabyAI's) tokens are
the same for every group, responses of 1-5 turns of ~30 action tokens and ~60 observation tokens.
Random token ids on the tiny model (or ``--model``); the update is the same either way (the sums run
in another order), which is checked here too.

Three settings train from the same weights on the same batch, in turn, ``--repeats`` times each
(mini-batches of ``--mini-batch`` shuffled trajectories, the same in each setting)
after one warm-up step each: a prompt copy per sample (``share_prompts`` off), one copy per group's
prompt (``share_prompt_prefixes`` off) and, in addition, one copy of the prefix all prompts of a row
share (the default). Printed: median update seconds, tokens forwarded, and the ratios to the copies.

Usage: python benchmarks/shared_prompt_bench.py [--groups 4] [--group-size 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
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
BABYAI_COMMON_PREFIX = 256  # tokens every BabyAI prompt starts with (chat template, system prompt, instructions)
SETTINGS = {  # label: (share_prompts, share_prompt_prefixes)
    "a prompt copy per sample": (False, False),
    "a copy per group's prompt": (True, False),
    "and of the common prefix": (True, True),
}


def babyai_shaped_batch(
    groups: int, group_size: int, vocab: int, seed: int, common_prefix: int = BABYAI_COMMON_PREFIX
) -> list[rl_pb2.Trajectory]:
    """``groups`` x ``group_size`` trajectories; the samples of a group start from its first sample's prompt,
    and every prompt starts with the same ``common_prefix`` tokens (the environment's system prompt)."""
    profile = Profile(groups * group_size, **BABYAI_PROFILE_PER_GROUP)
    batch = synthetic_batch(profile, vocab, seed, group_size)
    prompts = {t.group_id: list(t.prompt_token_ids) for t in reversed(batch)}
    system = list(batch[0].prompt_token_ids[:common_prefix])
    for t in batch:
        prompt = prompts[t.group_id]
        del t.prompt_token_ids[:]
        t.prompt_token_ids.extend(system + prompt[len(system) :])
    return batch


def scratch_dir(prefix: str) -> Path:
    """A new temporary folder for a bench's trainers, removed when the bench exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def update_bench_parser(description: str | None) -> argparse.ArgumentParser:
    """Options of the update benches (this one, mini-batch grouping, packed attention): the learning check's shape."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--mini-batch", type=int, default=8, help="trajectories per optimiser step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="as in the learning check")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def update_bench_trainer(args: argparse.Namespace, output_dir: Path, **overrides: Any) -> RLTrainer:
    """A GRPO trainer of the update benches, shaped by ``args`` (no KL, learning rate 1e-5), plus ``overrides``."""
    settings: dict[str, Any] = {
        "model": args.model,
        "output_dir": output_dir,
        "algorithm": "grpo",
        "group_size": args.group_size,
        "mini_batch_size": args.mini_batch,
        "learning_rate": 1e-5,
        "kl_coef": 0.0,
        "micro_batch_tokens": args.micro_batch_tokens,
        "bf16": args.bf16,
        "tensorboard": False,
        "otel_metrics": False,
        "seed": args.seed,
    }
    return RLTrainer(RLTrainerConfig(**(settings | overrides)), write_metrics=False)


def check_update_bench_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.groups, args.group_size, args.mini_batch, args.repeats) < 1:
        parser.error("--groups, --group-size, --mini-batch and --repeats must be >= 1")


def main(argv: Sequence[str] | None = None) -> int:
    parser = update_bench_parser(__doc__)
    parser.add_argument("--common-prefix", type=int, default=BABYAI_COMMON_PREFIX, help="tokens all prompts share")
    args = parser.parse_args(argv)
    check_update_bench_args(parser, args)
    if args.common_prefix < 0:
        parser.error("--common-prefix must be >= 0")

    work = scratch_dir("shared-prompt-bench-")
    trainers = {}
    for n, (label, (share, prefixes)) in enumerate(SETTINGS.items()):
        trainers[label] = update_bench_trainer(args, work / str(n), share_prompts=share, share_prompt_prefixes=prefixes)
    model_config: Any = trainers["a prompt copy per sample"].policy.config
    vocab = int(model_config.vocab_size)
    print(f"# shared-prompt update bench, {args.model}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))

    seconds: dict[str, list[float]] = {label: [] for label in SETTINGS}
    tokens: dict[str, float] = {}
    grad_norms: dict[str, list[float]] = {label: [] for label in SETTINGS}
    for repeat in range(args.repeats + 1):
        batch = babyai_shaped_batch(args.groups, args.group_size, vocab, args.seed + repeat, args.common_prefix)
        for t in batch:  # fresh ids each round: the trainers drop trajectories they have seen
            t.trajectory_id = f"{repeat}/{t.trajectory_id}"
        for label, trainer in trainers.items():
            started = time.perf_counter()
            metrics = trainer.train_step(batch)
            elapsed = time.perf_counter() - started
            if repeat > 0:  # the first round warms up every setting
                seconds[label].append(elapsed)
            tokens[label] = metrics.train["tokens"]
            grad_norms[label].append(metrics.train["grad_norm"])
    sampled = sum(sum(t.loss_mask) for t in batch)
    base = "a prompt copy per sample"
    for label in SETTINGS:
        ratio = statistics.median(seconds[base]) / statistics.median(seconds[label])
        print(
            f"{label:>26}: update {statistics.median(seconds[label]):.2f} s median of {args.repeats}"
            f" (min {min(seconds[label]):.2f}), {tokens[label]:.0f} tokens forwarded"
            f" ({tokens[label] / tokens[base]:.2f} of the copies'), {sampled} sampled; speed-up {ratio:.2f}x"
        )
    gap = max(
        abs(a - b) / max(abs(a), 1e-12)
        for label in SETTINGS
        for a, b in zip(grad_norms[base], grad_norms[label], strict=True)
    )
    print(f"same update: gradient norms of the {args.repeats + 1} steps agree within {gap:.1e} (relative)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
