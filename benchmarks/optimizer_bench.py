"""AdamW step time on the tiny model's parameters: torch's fused kernel against the default (foreach) one.

The trainer's CPU engine (`agentgym.trainer.backend.fused_adamw`) uses the fused kernel. Both
optimisers start from the same weights and take ``--steps`` steps on the same random gradients;
printed: median milliseconds a step, the ratio, and the largest difference between the two sets of
weights at the end (the same update up to float rounding).

Usage: python benchmarks/optimizer_bench.py [--model builtin:tiny] [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM

from agentgym.inference.models import resolve_model
from agentgym.trainer.backend import OptimizerSettings, fused_adamw


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=torch.float32)
    models = {"default": model, "fused": copy.deepcopy(model)}
    settings = OptimizerSettings(lr=2e-4)
    optimizers = {
        "default": torch.optim.AdamW(
            list(models["default"].parameters()),
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
        ),
        "fused": fused_adamw(list(models["fused"].parameters()), settings),
    }
    count = sum(p.numel() for p in model.parameters())
    print(f"# AdamW step bench, {args.model} ({count / 1e6:.1f} M parameters), {os.cpu_count()} CPUs")
    print(f"fused kernel: {optimizers['fused'].defaults.get('fused')}")
    generator = torch.Generator().manual_seed(args.seed)
    seconds: dict[str, list[float]] = {"default": [], "fused": []}
    for step in range(args.steps + 1):
        gradients = [torch.randn(p.shape, generator=generator) * 1e-2 for p in model.parameters()]
        for name, optimizer in optimizers.items():
            for p, g in zip(models[name].parameters(), gradients, strict=True):
                p.grad = g.clone()
            started = time.perf_counter()
            optimizer.step()
            if step > 0:  # the first allocates the moment estimates
                seconds[name].append(time.perf_counter() - started)
    for name in ("default", "fused"):
        print(f"{name:>8}: {1e3 * statistics.median(seconds[name]):.1f} ms a step (median of {args.steps})")
    ratio = statistics.median(seconds["default"]) / statistics.median(seconds["fused"])
    gap = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(models["default"].parameters(), models["fused"].parameters(), strict=True)
    )
    print(f"speed-up: {ratio:.1f}x; largest weight difference after {args.steps + 1} steps: {gap:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
