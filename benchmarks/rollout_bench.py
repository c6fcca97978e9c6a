"""Rollout benchmark: the agent loop's throughput and its own overhead, on real services.

Starts the inference server (tiny model) and the BabyAI service as separate processes, then plays the
same episodes two ways in this process and prints:
  - episodes in flight (peak) and end-to-end throughput of the concurrent loop vs a sequential loop
    on the same engine and environment (target: >= 32 in flight, >= 8x);
  - the worker's own time per turn, excluding inference and environment time (target: <= 5 ms).

Usage: python benchmarks/rollout_bench.py [--episodes 64] [--concurrency 64] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from agentgym.envs.client import AsyncEnvClient
from agentgym.inference.client import CompletionClient
from agentgym.inference.models import load_tokenizer, tiny_model_dir
from agentgym.messaging import free_port
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import run_episode
from agentgym.rollout.policy import InferencePolicy
from agentgym.rollout.prompts import template_for
from agentgym.rollout.tokens import ChatTokenizer

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]


@contextmanager
def process(args: list[str], health_url: str) -> Iterator[None]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(health_url, timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"{args[3:5]} did not start") from None
            time.sleep(0.2)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def requests(count: int, turns: int, max_tokens: int) -> list[rl_pb2.RolloutRequest]:
    return [
        rl_pb2.RolloutRequest(
            run="bench",
            request_id=f"bench/{n}",
            environment="babyai",
            task_id=f"GoToRedBall/s{n % 25}",
            max_turns=turns,
            max_tokens_per_turn=max_tokens,
            temperature=1.0,
            top_p=1.0,
            seed=n + 1,
        )
        for n in range(count)
    ]


async def play(
    batch: list[rl_pb2.RolloutRequest], concurrency: int, inference_url: str, env_url: str, chat: ChatTokenizer
) -> tuple[float, list[rl_pb2.Trajectory], int]:
    in_flight = peak = 0
    semaphore = asyncio.Semaphore(concurrency)
    async with CompletionClient(inference_url) as client, AsyncEnvClient(env_url, max_connections=concurrency) as env:
        policy = InferencePolicy(client)

        async def one(request: rl_pb2.RolloutRequest) -> rl_pb2.Trajectory:
            nonlocal in_flight, peak
            async with semaphore:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await run_episode(request, env, policy, chat, template_for("babyai"))
                finally:
                    in_flight -= 1

        started = time.perf_counter()
        trajectories = await asyncio.gather(*(one(r) for r in batch))
        wall = time.perf_counter() - started
    return wall, list(trajectories), peak


def overhead_per_turn_ms(trajectories: list[rl_pb2.Trajectory]) -> list[float]:
    """Worker time per turn: episode wall time minus time waiting on inference and the environment."""
    values = []
    for t in trajectories:
        wall = t.timings.finished_at - t.timings.started_at
        own = wall - t.timings.inference_seconds - t.timings.env_seconds
        values.append(own / max(t.turns_used, 1) * 1e3)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    model = tiny_model_dir()
    chat = ChatTokenizer(load_tokenizer(model))
    inference_port, env_port = free_port(), free_port()
    inference_url, env_url = f"http://127.0.0.1:{inference_port}", f"http://127.0.0.1:{env_port}"
    inference_cmd = [
        *AGENTGYM,
        "inference",
        "serve",
        "--model",
        str(model),
        "--port",
        str(inference_port),
        "--max-batch-size",
        str(args.concurrency),
        "--log-level",
        "warning",
    ]
    env_cmd = [
        *AGENTGYM,
        "env",
        "serve",
        "babyai",
        "--port",
        str(env_port),
        "--grpc-port",
        "0",
        "--max-episodes",
        str(args.concurrency + 8),
        "--log-level",
        "warning",
    ]
    with process(inference_cmd, f"{inference_url}/health"), process(env_cmd, f"{env_url}/healthz"):
        asyncio.run(play(requests(4, 2, 8), 4, inference_url, env_url, chat))  # warm-up
        batch = requests(args.episodes, args.turns, args.max_tokens)
        seq_wall, seq_traj, _ = asyncio.run(play(batch, 1, inference_url, env_url, chat))
        con_wall, con_traj, peak = asyncio.run(play(batch, args.concurrency, inference_url, env_url, chat))

    turns = sum(t.turns_used for t in seq_traj)
    errors = sum(t.termination == rl_pb2.TERMINATION_ERROR for t in seq_traj + con_traj)
    print(
        f"# rollout benchmark: {args.episodes} BabyAI episodes x <= {args.turns} turns, tiny model, "
        f"{args.max_tokens} tokens/turn; errors: {errors}"
    )
    print(f"sequential: {seq_wall:.1f} s, {args.episodes / seq_wall:.2f} episodes/s, {turns / seq_wall:.1f} turns/s")
    print(
        f"concurrent ({args.concurrency}): {con_wall:.1f} s, {args.episodes / con_wall:.2f} episodes/s; "
        f"peak in flight {peak}; speed-up {seq_wall / con_wall:.1f}x (target >= 8x)"
    )
    own = overhead_per_turn_ms(seq_traj)
    print(
        f"worker overhead per turn (excl. inference + env): p50 {statistics.median(own):.2f} ms, "
        f"max {max(own):.2f} ms (target <= 5 ms)"
    )


if __name__ == "__main__":
    main()
