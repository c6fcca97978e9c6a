"""Where the trainer process computes: a GRPO step in a worker thread vs on the main thread, interleaved.

The trainer's loop (`agentgym.trainer.loop.run_training`) hands each step to an executor while its event loop
keeps NATS alive. Before: asyncio's worker thread (`asyncio.to_thread`), served by a secondary glibc arena,
where every tensor over 64 MiB is a fresh `mmap`. Now: the main thread (`agentgym.trainer.main_thread`), the
loop beside it. Both run here through their real mechanisms on one BabyAI-shaped batch per round (the
learning check's shape: 4 x 8 trajectories, ~300-token prompts), alternating which goes first, in one process
and on one trainer, so the machine's noise falls on both alike. Printed: each step's seconds as it goes, then
the medians, the ratio and the machine's load.

Usage: python benchmarks/trainer_thread_bench.py [--model builtin:tiny] [--groups 4] [--group-size 8]
       [--mini-batch 8] [--repeats 5] [--no-bf16]
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the update benches' batch and trainer

from shared_prompt_bench import (
    BABYAI_COMMON_PREFIX,
    babyai_shaped_batch,
    check_update_bench_args,
    scratch_dir,
    update_bench_parser,
    update_bench_trainer,
)

from agentgym.cpus import available_cpus
from agentgym.trainer.main_thread import MainThreadExecutor, run_loop_beside


def in_worker_thread(step: Callable[[], Any]) -> float:
    """Seconds of `step` run as the loop ran it before: `asyncio.to_thread` from a loop on this thread."""

    async def timed() -> float:
        started = time.perf_counter()
        await asyncio.to_thread(step)
        return time.perf_counter() - started

    return asyncio.run(timed())


def on_main_thread(step: Callable[[], Any]) -> float:
    """Seconds of `step` run as the trainer process runs it now: on this thread, the loop in another."""
    executor = MainThreadExecutor()

    async def timed(stop: asyncio.Event) -> float:
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(executor, step)
        return time.perf_counter() - started

    return run_loop_beside(timed, executor, stop_signals=())


MODES: dict[str, Callable[[Callable[[], Any]], float]] = {
    "worker thread": in_worker_thread,
    "main thread": on_main_thread,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = update_bench_parser(__doc__)
    args = parser.parse_args(argv)
    check_update_bench_args(parser, args)
    trainer = update_bench_trainer(args, scratch_dir("trainer-thread-bench-"))
    vocab = int(trainer.policy.config.vocab_size)
    print(f"# trainer thread bench, {args.model}, {available_cpus()} usable CPUs, torch {torch.__version__}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())), flush=True)
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.repeats + 1):  # round 0 warms both up
        order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
        for n, mode in enumerate(order):
            batch = babyai_shaped_batch(
                args.groups, args.group_size, vocab, args.seed + 2 * round_ + n, BABYAI_COMMON_PREFIX
            )
            for t in batch:  # fresh ids: the trainer drops trajectories it has seen
                t.trajectory_id = f"{round_}/{mode}/{t.trajectory_id}"
            elapsed = MODES[mode](functools.partial(trainer.train_step, batch))
            if round_ > 0:
                seconds[mode].append(elapsed)
            print(f"  round {round_} {mode:13} {elapsed:6.2f} s" + ("  (warm-up)" if round_ == 0 else ""), flush=True)
    before, now = (statistics.median(seconds[mode]) for mode in MODES)
    one, five, _ = os.getloadavg()
    print(f"worker thread (before): {before:.2f} s a step, median of {args.repeats}")
    print(f"main thread (now):      {now:.2f} s a step, median of {args.repeats}")
    print(f"main thread vs worker thread: {before / now:.2f}x; load {one:.1f} (5 min {five:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
