"""The LM head and the labels' log-probs as one op (`linear_token_logprobs`), against ``log_softmax`` + gather.

Two measurements, each setting in turn in the same process, ``--repeats`` times after a warm-up:

1. the head alone, forward and backward, on ``[tokens, hidden]`` states for each of ``--tokens``
   (a mini-batch's action tokens: 700-970 in the learning check) with the entropy metric, as the
   trainer runs it: ``log_softmax(h @ W.T).gather(y)`` with the entropy from the log-softmax, against
   the fused op;
2. `RLTrainer.train_step` on the BabyAI-shaped GRPO batch of ``shared_prompt_bench.py`` (the learning
   check's shape), with the trainer's fused head switched off and on.

Printed: medians, the ratios, and the largest difference of the log-probs and gradients.

Usage: python benchmarks/lm_head_bench.py [--tokens 256,966,2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the update bench next to this script makes the batch
from shared_prompt_bench import babyai_shaped_batch, check_update_bench_args, update_bench_parser, update_bench_trainer

from agentgym.allocator import retain_freed_memory
from agentgym.trainer import packing
from agentgym.trainer.losses import linear_token_logprobs

HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def unfused_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer did before: the logits, their log-softmax, the gather, the entropy as a metric."""
    log_probs = torch.log_softmax(hidden @ weight.t(), dim=-1)
    logp = log_probs.gather(1, labels.unsqueeze(1)).squeeze(1)
    with torch.no_grad():
        detached = log_probs.detach()
        entropy = -(detached.exp() * detached).sum(dim=-1)
    return logp, entropy


def fused_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_token_logprobs(hidden, weight, labels, with_entropy=True)


def time_head(
    head: HeadFn, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, upstream: torch.Tensor
) -> tuple[float, list[torch.Tensor]]:
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    started = time.perf_counter()
    logp, entropy = head(h, w, labels)
    (upstream * logp).sum().backward()
    elapsed = time.perf_counter() - started
    assert h.grad is not None and w.grad is not None
    return elapsed, [logp.detach(), entropy, h.grad, w.grad]


def head_bench(args: argparse.Namespace, vocab: int, hidden_size: int) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.05
    heads: dict[str, HeadFn] = {"log_softmax + gather": unfused_head, "fused": fused_head}
    for tokens in args.tokens:
        hidden = torch.randn(tokens, hidden_size, generator=generator)
        labels = torch.randint(0, vocab, (tokens,), generator=generator)
        upstream = torch.randn(tokens, generator=generator)
        seconds: dict[str, list[float]] = {label: [] for label in heads}
        outputs: dict[str, list[torch.Tensor]] = {}
        for repeat in range(args.repeats + 1):
            for label, head in heads.items():
                elapsed, outputs[label] = time_head(head, hidden, weight, labels, upstream)
                if repeat:
                    seconds[label].append(elapsed)
        gap = max(
            float((a - b).abs().max()) for a, b in zip(outputs["fused"], outputs["log_softmax + gather"], strict=True)
        )
        base, fused = (statistics.median(seconds[label]) for label in heads)
        print(
            f"head, {tokens:5d} tokens x {vocab} vocab: log_softmax + gather {1e3 * base:7.1f} ms,"
            f" fused {1e3 * fused:7.1f} ms, {base / fused:.2f}x; outputs and gradients agree within {gap:.1e}",
            flush=True,
        )


def update_bench(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="lm-head-bench-"))
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = update_bench_parser(__doc__)
    parser.add_argument(
        "--tokens", type=lambda text: [int(n) for n in text.split(",")], default=[256, 966, 2048], help="head sizes"
    )
    parser.add_argument("--no-update", action="store_true", help="the head alone")
    args = parser.parse_args(argv)
    check_update_bench_args(parser, args)
    if min(args.tokens) < 1:
        parser.error("--tokens must all be >= 1")
    retain_freed_memory()  # as the trainer on CPU
    print(f"# LM head bench, {args.model}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())), flush=True)
    head_bench(args, vocab=49152, hidden_size=256)
    if not args.no_update:
        update_bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
