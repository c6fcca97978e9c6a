"""The LM head and the labels' log-probs as one op (`linear_token_logprobs`), against ``log_softmax`` + gather.

Two measurements, each setting in turn in the same process, ``--repeats`` times after a warm-up:

1. the head alone, forward and backward, on ``[tokens, hidden]`` states for each of ``--tokens``
   (a mini-batch's action tokens: 700-970 in the learning check) with the entropy metric, as the
   trainer runs it: ``log_softmax(h @ W.T).gather(y)`` with the entropy from the log-softmax, against
   the fused op;
2. the peak memory of one forward and backward of the head on ``--memory-tokens`` states, each setting
   in a child process of its own (the peak RSS over the RSS before it, glibc's default allocator so
   that freed memory goes back);
3. `RLTrainer.train_step` on the BabyAI-shaped GRPO batch of ``shared_prompt_bench.py`` (the learning
   check's shape), with the trainer's fused head switched off and on.

Printed: medians, the ratios, the peak memory against the size of one ``[tokens, vocab]`` float32
tensor, and the largest difference of the log-probs and gradients.

Usage: python benchmarks/lm_head_bench.py [--tokens 256,966,2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the update bench next to this script makes the batch
from cpu_allocator_bench import memory_status_mb
from shared_prompt_bench import (
    babyai_shaped_batch,
    check_update_bench_args,
    scratch_dir,
    update_bench_parser,
    update_bench_trainer,
)

from agentgym.allocator import DISABLE_VARIABLE, retain_freed_memory
from agentgym.trainer import packing

HEADS = {"log_softmax + gather": False, "fused": True}  # label: a plain nn.Linear head (the fused path)


def time_head(
    fused: bool, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, upstream: torch.Tensor
) -> tuple[float, list[torch.Tensor]]:
    """The trainer's head chunk, forward and backward, with the entropy as a metric (as in the update).

    A plain linear head takes `linear_token_logprobs`; the same weight behind any other callable takes
    the general path (logits, log-softmax, gather), which is what every head took before.
    """
    h = hidden.clone().requires_grad_()
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")  # no init: replaced
    linear.weight = torch.nn.Parameter(weight.clone())
    head = linear if fused else (lambda x: x @ linear.weight.t())
    started = time.perf_counter()
    logp, entropy = packing._head_chunk(h, labels, head, with_entropy=True, entropy_grad=False)
    (upstream * logp).sum().backward()
    elapsed = time.perf_counter() - started
    assert h.grad is not None and linear.weight.grad is not None
    return elapsed, [logp.detach(), entropy, h.grad, linear.weight.grad]


def head_bench(args: argparse.Namespace, vocab: int, hidden_size: int) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.05
    for tokens in args.tokens:
        hidden = torch.randn(tokens, hidden_size, generator=generator)
        labels = torch.randint(0, vocab, (tokens,), generator=generator)
        upstream = torch.randn(tokens, generator=generator)
        seconds: dict[str, list[float]] = {label: [] for label in HEADS}
        outputs: dict[str, list[torch.Tensor]] = {}
        for repeat in range(args.repeats + 1):
            for label, fused in HEADS.items():
                elapsed, outputs[label] = time_head(fused, hidden, weight, labels, upstream)
                if repeat:
                    seconds[label].append(elapsed)
        gap = max(
            float((a - b).abs().max()) for a, b in zip(outputs["fused"], outputs["log_softmax + gather"], strict=True)
        )
        base, fused = (statistics.median(seconds[label]) for label in HEADS)
        print(
            f"head, {tokens:5d} tokens x {vocab} vocab: log_softmax + gather {1e3 * base:7.1f} ms,"
            f" fused {1e3 * fused:7.1f} ms, {base / fused:.2f}x; outputs and gradients agree within {gap:.1e}",
            flush=True,
        )


def update_bench(args: argparse.Namespace) -> None:
    work = scratch_dir("lm-head-bench-")
    trainers = {}
    for label in ("unfused", "fused"):
        trainers[label] = update_bench_trainer(args, work / label)
    model_config: Any = trainers["fused"].policy.config
    fusable = packing._fusable_head
    seconds: dict[str, list[float]] = {label: [] for label in trainers}
    grad_norms: dict[str, float] = {}
    try:
        for repeat in range(args.repeats + 1):
            batch = babyai_shaped_batch(args.groups, args.group_size, int(model_config.vocab_size), args.seed + repeat)
            for t in batch:  # fresh ids each round: the trainers drop trajectories they have seen
                t.trajectory_id = f"{repeat}/{t.trajectory_id}"
            for label, trainer in trainers.items():
                # The unfused setting: the trainer's head check says no, so it takes the log_softmax path.
                packing._fusable_head = fusable if label == "fused" else (lambda head: False)  # type: ignore[assignment]
                started = time.perf_counter()
                metrics = trainer.train_step(batch)
                elapsed = time.perf_counter() - started
                if repeat:
                    seconds[label].append(elapsed)
                grad_norms[label] = metrics.train["grad_norm"]
    finally:
        packing._fusable_head = fusable  # type: ignore[assignment]
    base, fused = (statistics.median(seconds[label]) for label in trainers)
    print(
        f"update, {args.groups} x {args.group_size} BabyAI-shaped trajectories: unfused {base:.2f} s,"
        f" fused {fused:.2f} s (medians of {args.repeats}), {base / fused:.2f}x;"
        f" last grad norms {grad_norms['unfused']:.6f} / {grad_norms['fused']:.6f}"
    )


def peak_growth_mb(fused: bool, tokens: int, vocab: int, hidden_size: int, seed: int) -> float:
    """Growth of this process's peak RSS over one forward and backward of the head (run in a fresh child)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.05
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    upstream = torch.randn(tokens, generator=generator)
    before = memory_status_mb("VmRSS")
    time_head(fused, hidden, weight, labels, upstream)
    return memory_status_mb("VmHWM") - before


def memory_bench(args: argparse.Namespace, vocab: int, hidden_size: int) -> None:
    env = {**os.environ, DISABLE_VARIABLE: "0"}  # freed memory returns: the peak is what was live at once
    peaks = {}
    for label, fused in HEADS.items():
        command = [sys.executable, str(Path(__file__).resolve()), "--memory-child", "fused" if fused else "unfused"]
        command += ["--memory-tokens", str(args.memory_tokens), "--seed", str(args.seed)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        peaks[label] = float(done.stdout.strip().splitlines()[-1])
    logits_mb = args.memory_tokens * vocab * 4 / 2**20
    base, fused_peak = peaks.values()
    print(
        f"peak memory, {args.memory_tokens} tokens (one [tokens, vocab] float32 tensor: {logits_mb:.0f} MB):"
        f" log_softmax + gather {base:.0f} MB, fused {fused_peak:.0f} MB, {base / max(fused_peak, 1.0):.2f}x less",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = update_bench_parser(__doc__)
    parser.add_argument(
        "--tokens", type=lambda text: [int(n) for n in text.split(",")], default=[256, 966, 2048], help="head sizes"
    )
    parser.add_argument("--memory-tokens", type=int, default=4096, help="head size of the peak-memory measurement")
    parser.add_argument("--no-update", action="store_true", help="the head alone")
    parser.add_argument("--memory-child", choices=("fused", "unfused"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_update_bench_args(parser, args)
    if min(args.tokens) < 1 or args.memory_tokens < 1:
        parser.error("--tokens and --memory-tokens must all be >= 1")
    if args.memory_child:
        print(peak_growth_mb(args.memory_child == "fused", args.memory_tokens, 49152, 256, args.seed))
        return 0
    retain_freed_memory()  # as the trainer on CPU
    print(f"# LM head bench, {args.model}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())), flush=True)
    head_bench(args, vocab=49152, hidden_size=256)
    memory_bench(args, vocab=49152, hidden_size=256)
    if not args.no_update:
        update_bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
