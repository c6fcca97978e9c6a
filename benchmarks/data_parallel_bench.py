"""Data-parallel training step: N ranks against one rank, same batch, same DeepSpeed engine.

Starts the ranks itself (one process each, ``RANK`` / ``WORLD_SIZE`` ... as the DeepSpeed launcher
sets them), first one rank (the baseline), then ``--ranks``. Rank 0 drives the trainer as the
training loop does (each call announced to the others, ``agentgym.trainer.distributed``); every
step trains on the same synthetic multi-turn batch (prompt | action obs action ...; loss on the
actions), packed into rows of ``--micro-batch-tokens``; the rows of each mini-batch are split over
the ranks. On CPU each rank gets ``--threads`` intra-op threads, so N ranks use N times the cores
of the baseline (on GPUs: one GPU each).

Printed: step time and trained tokens/s of each world size, the speed-up over one rank and the
scaling efficiency (speed-up / ranks); per rank, the optimizer state it holds (fp32 master weights
and AdamW moments: ZeRO partitions them over the ranks) and its peak resident memory.

Usage:
    python benchmarks/data_parallel_bench.py                 # 2 ranks, ZeRO-2, ~1 min on CPU
    python benchmarks/data_parallel_bench.py --stage 3 --ranks 2 --steps 6
    python benchmarks/data_parallel_bench.py --smoke         # tiny model, 2 steps (the tests run this)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from agentgym.messaging import free_port
from agentgym.proto import rl_pb2


def synthetic_batch(args: argparse.Namespace, step: int, vocab: int) -> list[rl_pb2.Trajectory]:
    """``--groups`` x ``--group-size`` episodes of ``--turns`` turns; mixed outcomes in every group."""
    rng = random.Random(f"dp-bench/{step}")
    trajectories = []
    for g in range(args.groups):
        prompt = [rng.randrange(200, vocab) for _ in range(args.prompt_tokens)]
        for s in range(args.group_size):
            response: list[int] = []
            mask: list[int] = []
            for turn in range(args.turns):
                action = [rng.randrange(200, vocab) for _ in range(rng.randint(8, 24))]
                response += action
                mask += [1] * len(action)
                if turn < args.turns - 1:
                    observation = [rng.randrange(200, vocab) for _ in range(rng.randint(20, 60))]
                    response += observation
                    mask += [0] * len(observation)
            won = s % 2 == 0
            trajectories.append(
                rl_pb2.Trajectory(
                    run="bench",
                    trajectory_id=f"{step}/{g}/{s}",
                    group_id=f"{step}/{g}",
                    sample_index=s,
                    task_id=f"task-{g}",
                    environment="babyai",
                    step=step,
                    policy_version=step,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    loss_mask=mask,
                    sampled_logprobs=[-3.0 if m else 0.0 for m in mask],
                    success=won,
                    final_score=float(won),
                    termination=rl_pb2.TERMINATION_DONE if won else rl_pb2.TERMINATION_HORIZON,
                )
            )
    return trajectories


def optimizer_state_bytes(trainer: Any) -> int:
    """Bytes of the optimizer state this rank holds: its fp32 master weights and AdamW moments."""
    zero = trainer.engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    # ZeRO-3 hands its flat fp32 partitions to the inner AdamW only during a step; ZeRO-1/2 keep them there.
    masters = getattr(zero, "fp32_partitioned_groups_flat", None) or [
        p for group in inner.param_groups for p in group["params"]
    ]
    total = 0
    for master in masters:
        total += master.numel() * master.element_size()
        for value in inner.state.get(master, {}).values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    """One rank: build the trainer, train warm-up + timed steps, print this rank's figures as JSON."""
    torch.set_num_threads(args.threads)
    from agentgym.inference.models import tiny_model_dir
    from agentgym.trainer.config import RLTrainerConfig
    from agentgym.trainer.distributed import follow, init_data_parallel
    from agentgym.trainer.loop import _on_all_ranks
    from agentgym.trainer.trainer import RLTrainer

    dp = init_data_parallel()
    model = tiny_model_dir(layers=args.layers, hidden=args.hidden, heads=args.heads)
    config = RLTrainerConfig(
        model=str(model),
        output_dir=Path(args.work) / f"world-{dp.world_size}",
        run="dp-bench",
        algorithm="grpo",
        group_size=args.group_size,
        mini_batch_size=args.groups * args.group_size,
        micro_batch_tokens=args.micro_batch_tokens,
        learning_rate=1e-5,
        kl_coef=0.0,
        total_steps=10**6,
        tensorboard=False,
        otel_metrics=False,
        curriculum={"kind": "fixed", "max_turns": args.turns},
        backend="deepspeed",
        zero_stage=args.stage,
        gpus=dp.world_size,
        bf16=torch.cuda.is_available(),
    )
    trainer = RLTrainer(config, data_parallel=dp)
    vocab = int(trainer.policy.config.vocab_size)
    result: dict[str, Any] = {"rank": dp.rank, "world": dp.world_size}
    if dp.is_main:
        times, tokens = [], []
        try:
            for step in range(args.warmup + args.steps):
                batch = synthetic_batch(args, step, vocab)
                started = time.perf_counter()
                metrics = _on_all_ranks(trainer, "train_step", batch)
                if step >= args.warmup:
                    times.append(time.perf_counter() - started)
                    tokens.append(metrics.train["tokens"])
        finally:
            dp.stop_followers()
        result.update(step_s=sum(times) / len(times), tokens=sum(tokens) / len(tokens))
    else:
        follow(trainer)
    result["optimizer_bytes"] = optimizer_state_bytes(trainer)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def run_world(args: argparse.Namespace, world: int, work: str) -> list[dict[str, Any]]:
    port = free_port()
    argv = [sys.executable, __file__, "--worker", "--work", work, *args.forward]
    ranks = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(args.threads),
        }
        ranks.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for process in ranks:
        out, err = process.communicate(timeout=args.timeout)
        if process.returncode != 0:
            raise SystemExit(f"a rank of the {world}-rank run failed:\n{err[-3000:]}")
        line = next(line for line in out.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    return sorted(results, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--smoke", action="store_true", help="tiny model, few short steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.layers, args.hidden, args.groups, args.turns = 1, 1, 2, 64, 2, 2
        args.prompt_tokens, args.micro_batch_tokens = 40, 256
    if args.worker:
        worker(args)
        return 0
    if args.ranks < 2:
        parser.error("--ranks must be >= 2 (one rank is the baseline)")
    keep = {"ranks", "smoke", "worker", "work", "timeout"}
    args.forward = []
    for name, value in vars(args).items():
        if name not in keep and name != "forward":
            args.forward += [f"--{name.replace('_', '-')}", str(value)]
    with tempfile.TemporaryDirectory(prefix="dp-bench-") as work:
        one = run_world(args, 1, work)
        many = run_world(args, args.ranks, work)
    print(
        f"data-parallel training step: ZeRO-{args.stage}, model {args.layers}x{args.hidden}, "
        f"{args.groups * args.group_size} episodes of {args.turns} turns, rows of {args.micro_batch_tokens} tokens, "
        f"{args.threads} thread(s) per rank, {args.steps} timed steps"
    )
    base_tps = one[0]["tokens"] / one[0]["step_s"]
    for results in (one, many):
        lead = results[0]
        tps = lead["tokens"] / lead["step_s"]
        speedup = tps / base_tps
        print(
            f"  {lead['world']} rank(s): step {lead['step_s']:.3f} s, {tps:,.0f} tokens/s, "
            f"speed-up {speedup:.2f}x, efficiency {speedup / lead['world']:.0%}"
        )
        for r in results:
            print(
                f"    rank {r['rank']}: optimizer state {r['optimizer_bytes'] / 2**20:.1f} MiB "
                f"({r['optimizer_bytes'] / one[0]['optimizer_bytes']:.2f}x one rank's), "
                f"peak RSS {r['peak_rss_mb']:.0f} MiB"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
