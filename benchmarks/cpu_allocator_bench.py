"""CPU step times with freed memory retained for reuse (`agentgym.allocator`), against glibc's defaults.

glibc gives every large allocation fresh pages from the kernel, which faults in and zeroes each page at
first touch; `retain_freed_memory` (called by the trainer and the inference engine on CPU) keeps freed
buffers for the next tensor instead. The setting is process-wide, so each measurement runs in a child
process of its own, ``--rounds`` times per setting, alternating (``AGENTGYM_RETAIN_FREED_MEMORY=0`` is
the baseline). Each child measures, after one warm-up each:

- ``exp``: ``exp`` over ``[--head-tokens, vocab]`` log-probs (a new output tensor each time), the
  shape of the LM head's outputs for a mini-batch's action tokens;
- ``update``: `RLTrainer.train_step` on a BabyAI-shaped GRPO batch (the learning check's shape, see
  ``shared_prompt_bench.py``), the tiny model;
- ``decode``: the inference engine generating ``--max-tokens`` tokens for ``--concurrency`` concurrent
  prompts of ``--prompt-tokens`` random ids (a batch of rollout turns);

plus its minor page faults and peak RSS. Printed: medians per setting, the ratio baseline / retained,
and the memory cost.

Usage: python benchmarks/cpu_allocator_bench.py [--rounds 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the update bench next to this script makes the batch
from shared_prompt_bench import babyai_shaped_batch, scratch_dir, update_bench_parser, update_bench_trainer

from agentgym.allocator import DISABLE_VARIABLE, retain_freed_memory
from agentgym.inference.engine import Engine, SamplingParams
from agentgym.inference.models import resolve_model

SETTINGS = {"glibc defaults": "0", "retained": "1"}  # label: AGENTGYM_RETAIN_FREED_MEMORY


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def memory_status_mb(field: str) -> float:
    """``VmHWM`` (peak RSS) or ``VmRSS`` of this process from ``/proc/self/status``, in MB.

    Not ``ru_maxrss``: Linux carries that over from the parent across fork and exec, so a child
    started by a process that peaked higher reports the parent's peak.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def time_exp(tokens: int, vocab: int, repeats: int) -> float:
    logprobs = torch.log_softmax(torch.randn(tokens, vocab), dim=-1)
    times = []
    for repeat in range(repeats + 1):
        started = time.perf_counter()
        out = logprobs.exp()
        elapsed = time.perf_counter() - started
        del out
        if repeat:
            times.append(elapsed)
    return statistics.median(times)


def time_update(args: argparse.Namespace, work: Path) -> tuple[float, float]:
    trainer = update_bench_trainer(args, work / "update")
    model_config: Any = trainer.policy.config
    vocab = int(model_config.vocab_size)
    times, tokens = [], 0.0
    for repeat in range(args.repeats + 1):
        batch = babyai_shaped_batch(args.groups, args.group_size, vocab, args.seed + repeat)
        for t in batch:  # fresh ids each round: the trainer drops trajectories it has seen
            t.trajectory_id = f"{repeat}/{t.trajectory_id}"
        started = time.perf_counter()
        metrics = trainer.train_step(batch)
        elapsed = time.perf_counter() - started
        tokens = metrics.train["tokens"]
        if repeat:
            times.append(elapsed)
    return statistics.median(times), tokens


async def time_decode(args: argparse.Namespace, model_dir: Path) -> float:
    engine = Engine(model_dir, max_batch_size=args.concurrency)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed, ignore_eos=True)
    times = []
    try:
        for repeat in range(args.repeats + 1):
            prompts = [
                torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist()
                for _ in range(args.concurrency)
            ]
            started = time.perf_counter()
            await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            elapsed = time.perf_counter() - started
            if repeat:
                times.append(elapsed)
    finally:
        engine.close()
    return statistics.median(times)


def child(args: argparse.Namespace) -> dict[str, Any]:
    if os.environ.get(DISABLE_VARIABLE) != "0":
        assert retain_freed_memory(), "this platform keeps no freed memory (not glibc)"
    work = scratch_dir("cpu-allocator-bench-")
    faults = minor_faults()
    exp_s = time_exp(args.head_tokens, 49152, max(args.repeats, 5))
    exp_faults = minor_faults() - faults
    update_s, tokens = time_update(args, work)
    decode_s = asyncio.run(time_decode(args, resolve_model(args.model)))
    return {
        "exp_s": exp_s,
        "exp_faults": exp_faults,
        "update_s": update_s,
        "update_tokens": tokens,
        "decode_s": decode_s,
        "minor_faults": minor_faults() - faults,
        "peak_rss_mb": memory_status_mb("VmHWM"),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = update_bench_parser(__doc__)  # the update's shape: the learning check's
    parser.set_defaults(repeats=3)  # of each measurement in a child
    parser.add_argument("--rounds", type=int, default=2, help="child processes per setting, alternating")
    parser.add_argument("--head-tokens", type=int, default=800)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=380)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    counts = ("rounds", "repeats", "head_tokens", "groups", "group_size", "mini_batch", "concurrency", "max_tokens")
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens must be >= 1, not {args.prompt_tokens}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    print(f"# CPU allocator bench, {args.model}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items()) if k != "child"), flush=True)
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in SETTINGS}
    for round_index in range(args.rounds):
        for label, value in SETTINGS.items():
            env = {**os.environ, DISABLE_VARIABLE: value}
            command = [sys.executable, str(Path(__file__).resolve()), *forwarded, "--child"]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stdout + done.stderr, file=sys.stderr)
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[label].append(result)
            print(
                f"round {round_index}, {label}: exp {1e3 * result['exp_s']:.1f} ms, update {result['update_s']:.2f} s,"
                f" decode {result['decode_s']:.2f} s, {result['minor_faults']} minor faults,"
                f" peak RSS {result['peak_rss_mb']:.0f} MB",
                flush=True,
            )

    def median(label: str, key: str) -> float:
        return statistics.median(r[key] for r in results[label])

    base, retained = SETTINGS
    print()
    print(f"{'':>16} {'exp ms':>8} {'update s':>9} {'decode s':>9} {'page faults':>12} {'peak RSS MB':>12}")
    for label in SETTINGS:
        print(
            f"{label:>16} {1e3 * median(label, 'exp_s'):8.1f} {median(label, 'update_s'):9.2f}"
            f" {median(label, 'decode_s'):9.2f} {median(label, 'minor_faults'):12.0f}"
            f" {median(label, 'peak_rss_mb'):12.0f}"
        )
    print(
        f"speed-up (defaults / retained): exp {median(base, 'exp_s') / median(retained, 'exp_s'):.2f}x,"
        f" update {median(base, 'update_s') / median(retained, 'update_s'):.2f}x,"
        f" decode {median(base, 'decode_s') / median(retained, 'decode_s'):.2f}x;"
        f" peak RSS {median(retained, 'peak_rss_mb') / median(base, 'peak_rss_mb'):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
