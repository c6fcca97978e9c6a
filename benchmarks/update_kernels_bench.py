"""Two CPU costs of the trainer's update, each against how it was: rows of a new length, and the entropy's dot product.

1. **Shape buckets** (`agentgym.trainer.packing.CPU_SHAPE_BUCKET`). oneDNN builds a matmul kernel for every new
   shape and caches it; a packed row has a new length nearly every time. Measured two ways:
   - a forward + backward of the model (bf16 autocast, as the trainer) on ``--rows`` rows of random lengths
     (``--min-tokens`` to ``--max-tokens``), each row at its exact length and padded up to a multiple of the
     bucket, in turn, in one process: seconds per row;
   - `RLTrainer.train_step` on BabyAI-shaped GRPO batches (``shared_prompt_bench``'s: 4 groups x 8 samples,
     mini-batches of 8): ``--steps`` steps per child process (a fresh kernel cache, as a training process starts),
     children alternating between exact lengths (bucket 1) and the bucket, ``--rounds`` rounds; median seconds
     per step over all steps but each child's first.
2. **The entropy** (`agentgym.trainer.losses._entropy_of`): -sum_v p_v log p_v of ``--scored`` tokens over the
   vocabulary as one batched dot product under bf16 autocast (which copies both ``[n, V]`` operands to bf16 first:
   the update before), the same in float32, and as the trainer takes it now (float32, `ENTROPY_ROWS` rows at a
   time); milliseconds, interleaved.

Usage: python benchmarks/update_kernels_bench.py [--rows 48] [--steps 6] [--rounds 3] [--scored 600]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from agentgym.trainer import losses, packing

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the benches next to this script: the timer, and the BabyAI-shaped update batches
from sampler_bench import per_call_ms  # noqa: E402


def _load_model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from agentgym.inference.models import resolve_model

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(resolve_model(name)), dtype=torch.float32)
    return model


def forward_backward_rows(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of a forward + backward per row, exact lengths vs padded to the bucket (interleaved)."""
    model = _load_model(args.model)
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randperm(args.max_tokens - args.min_tokens, generator=generator)[: args.rows] + args.min_tokens
    bucket = packing.CPU_SHAPE_BUCKET

    def step(tokens: int) -> float:
        ids = torch.randint(3, 40000, (1, tokens), generator=generator)
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model.model(input_ids=ids).last_hidden_state
        hidden.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    step(args.min_tokens)  # warm-up
    seconds: dict[str, list[float]] = {"exact": [], "bucket": []}
    for length in lengths.tolist():
        padded = length + (-length % bucket)
        seconds["exact"].append(step(length))
        seconds["bucket"].append(step(padded))
    return {name: statistics.median(values) for name, values in seconds.items()}


def train_steps(model: str, steps: int, bucket: int, seed: int) -> list[float]:
    """Seconds of each `train_step` of a fresh trainer with this bucket (run in a child process)."""
    from shared_prompt_bench import babyai_shaped_batch, scratch_dir, update_bench_parser, update_bench_trainer

    packing.CPU_SHAPE_BUCKET = bucket
    args = update_bench_parser(None).parse_args(["--model", model, "--seed", str(seed)])
    trainer = update_bench_trainer(args, scratch_dir("update-kernels-bench-"))
    vocab = int(trainer.policy.config.vocab_size)
    seconds = []
    for step in range(steps):
        batch = babyai_shaped_batch(args.groups, args.group_size, vocab, seed + step)
        for trajectory in batch:  # fresh ids every step: the trainer drops trajectories it has seen
            trajectory.trajectory_id = f"{step}/{trajectory.trajectory_id}"
        started = time.perf_counter()
        trainer.train_step(batch)
        seconds.append(time.perf_counter() - started)
    return seconds


def entropy_ms(scored: int, vocabulary: int, repeats: int) -> dict[str, float]:
    """Milliseconds of the entropy's batched dot product under bf16 autocast and in float32, interleaved."""
    generator = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(torch.randn(scored, vocabulary, generator=generator) * 3, dim=-1)
    probs = log_probs.exp()

    def dot() -> torch.Tensor:
        return -torch.bmm(probs.unsqueeze(1), log_probs.unsqueeze(2)).view(-1)

    def under_autocast() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return dot()

    def in_float32() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):
            return dot()

    def now() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return losses._entropy_of(probs, log_probs)

    times: dict[str, list[float]] = {"autocast": [], "float32": [], "now": []}
    for _ in range(3):
        times["autocast"].append(per_call_ms(under_autocast, repeats))
        times["float32"].append(per_call_ms(in_float32, repeats))
        times["now"].append(per_call_ms(now, repeats))
    error = float((under_autocast().float() - in_float32()).abs().max())
    torch.testing.assert_close(now(), in_float32(), atol=1e-3, rtol=1e-5)
    return {**{name: statistics.median(values) for name, values in times.items()}, "bf16_error": error}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--rows", type=int, default=48, help="rows of the forward/backward comparison")
    parser.add_argument("--min-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=6, help="train steps per child process (0: skip)")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per setting, alternating")
    parser.add_argument("--scored", type=int, default=600, help="scored tokens of the entropy comparison")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child-bucket", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.rows, args.rounds, args.scored, args.repeats) < 1 or args.steps < 0:
        parser.error("--rows, --rounds, --scored and --repeats must be >= 1, --steps >= 0")
    if not 0 < args.min_tokens < args.max_tokens or args.max_tokens - args.min_tokens < args.rows:
        parser.error("need 0 < --min-tokens < --max-tokens with at least --rows lengths between them")
    if args.child_bucket is not None:
        print(json.dumps(train_steps(args.model, args.steps, args.child_bucket, args.seed)))
        return 0

    load = os.getloadavg()[0]
    print(f"# update kernels bench, {args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    bucket = packing.CPU_SHAPE_BUCKET
    rows = forward_backward_rows(args)
    print(
        f"forward + backward of a {args.min_tokens}-{args.max_tokens}-token row (bf16 autocast), median of {args.rows}:"
        f" exact length {rows['exact'] * 1000:.0f} ms, padded to a multiple of {bucket}"
        f" {rows['bucket'] * 1000:.0f} ms -> {rows['exact'] / rows['bucket']:.2f}x",
        flush=True,
    )
    if args.steps:
        steps: dict[int, list[float]] = {1: [], bucket: []}
        for round_ in range(args.rounds):
            for size in (1, bucket) if round_ % 2 == 0 else (bucket, 1):
                command = [sys.executable, __file__, "--child-bucket", str(size), "--steps", str(args.steps)]
                command += ["--model", args.model, "--seed", str(args.seed)]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                times = json.loads(done.stdout.strip().splitlines()[-1])
                steps[size].extend(times[1:])  # each process's first step builds everything
                print(f"  [{round_ + 1}/{args.rounds}] bucket {size:>3}: {statistics.median(times[1:]):.2f} s a step")
        exact, bucketed = statistics.median(steps[1]), statistics.median(steps[bucket])
        print(
            f"train_step (4 x 8 BabyAI-shaped trajectories), median of {len(steps[1])}: exact lengths {exact:.2f} s,"
            f" padded to {bucket} {bucketed:.2f} s -> {exact / bucketed:.2f}x",
            flush=True,
        )
    entropy = entropy_ms(args.scored, 49152, args.repeats)
    print(
        f"entropy of {args.scored} x 49,152 (medians of 3): one dot product under bf16 autocast (before)"
        f" {entropy['autocast']:.1f} ms, in float32 {entropy['float32']:.1f} ms, float32 by row chunks (now)"
        f" {entropy['now']:.1f} ms -> {entropy['autocast'] / entropy['now']:.2f}x;"
        f" the bf16 result is off by up to {entropy['bf16_error']:.3f} nats"
    )
    print(f"load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
