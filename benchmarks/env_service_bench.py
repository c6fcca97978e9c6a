"""Environment-service benchmark: per-step overhead over in-process, memory of live episodes, leaks.

Runs the real service (`agentgym env serve`) as a separate process on loopback and prints:
  1. per-step overhead of HTTP and gRPC over an in-process `env.step`, with 64 concurrent episodes
     (amortised: wall time per step minus the in-process step time; plus latency percentiles);
  2. RSS of the service with N live episodes (default 256) against the idle service;
  3. RSS after 1,000 and after 10,000 create/step/close episodes (leak check).

Usage: python benchmarks/env_service_bench.py [--env babyai] [--episodes 10000] [--live 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import httpx

from agentgym.envs import environment_class, make
from agentgym.envs.client import AsyncEnvClient
from agentgym.messaging import free_port
from agentgym.proto import env_pb2, env_pb2_grpc

# A step that never ends the episode, per kind (so a worker can step one episode many times).
STEADY_ACTION = {"babyai": "check available actions", "textcraft": "inventory"}


@dataclass
class Service:
    process: subprocess.Popen[bytes]
    http_url: str
    grpc_target: str

    def cpu_seconds(self) -> float:
        """User + system CPU time the service process has used."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")


@contextmanager
def service(env: str, max_episodes: int) -> Iterator[Service]:
    http_port, grpc_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "agentgym.cli",
        "env",
        "serve",
        env,
        "--port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--max-episodes",
        str(max_episodes),
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/healthz", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError(f"{env} service did not start") from None
            time.sleep(0.1)
    try:
        yield Service(process, url, f"127.0.0.1:{grpc_port}")
    finally:
        process.terminate()
        process.wait(timeout=10)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_process_step_seconds(env_name: str, task_id: str, action: str, steps: int) -> list[float]:
    env = make(env_name)
    env.reset(task_id)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        env.step(action)
        times.append(time.perf_counter() - start)
    env.close()
    return times


async def http_concurrent(
    svc: Service, task_id: str, action: str, episodes: int, steps: int
) -> tuple[float, list[float]]:
    async with AsyncEnvClient(svc.http_url, max_connections=episodes) as client:
        ids = [(await client.create(task_id=task_id)).episode_id for _ in range(episodes)]
        latencies: list[float] = []

        async def worker(episode_id: str) -> None:
            for _ in range(steps):
                start = time.perf_counter()
                await client.step(episode_id, action)
                latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in ids))
        wall = time.perf_counter() - started
        for episode_id in ids:
            await client.close(episode_id)
    return wall, latencies


async def grpc_concurrent(
    svc: Service, task_id: str, action: str, episodes: int, steps: int
) -> tuple[float, list[float]]:
    async with grpc.aio.insecure_channel(svc.grpc_target) as channel:
        stub = env_pb2_grpc.EnvServiceStub(channel)
        selector = env_pb2.TaskSelector(task_id=task_id)
        ids = [
            (await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=selector))).episode_id for _ in range(episodes)
        ]
        latencies: list[float] = []

        async def worker(episode_id: str) -> None:
            request = env_pb2.StepRequest(episode_id=episode_id, action=action)
            for _ in range(steps):
                start = time.perf_counter()
                await stub.Step(request)
                latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in ids))
        wall = time.perf_counter() - started
        for episode_id in ids:
            await stub.CloseEpisode(env_pb2.EpisodeRef(episode_id=episode_id))
    return wall, latencies


async def sequential_http(svc: Service, task_id: str, action: str, steps: int) -> list[float]:
    async with AsyncEnvClient(svc.http_url) as client:
        episode_id = (await client.create(task_id=task_id)).episode_id
        latencies = []
        for _ in range(steps):
            start = time.perf_counter()
            await client.step(episode_id, action)
            latencies.append(time.perf_counter() - start)
        await client.close(episode_id)
    return latencies


async def live_episodes(svc: Service, task_ids: list[str], live: int, action: str) -> float:
    async with AsyncEnvClient(svc.http_url) as client:
        ids = [(await client.create(task_id=task_ids[i % len(task_ids)])).episode_id for i in range(live)]
        for episode_id in ids:
            await client.step(episode_id, action)
        rss = svc.rss_mib()
        for episode_id in ids:
            await client.close(episode_id)
    return rss


async def churn(svc: Service, task_ids: list[str], action: str, episodes: int, concurrency: int = 16) -> None:
    """`episodes` x (create, 3 steps, close), `concurrency` at a time, cycling through tasks."""
    counter = iter(range(episodes))
    async with AsyncEnvClient(svc.http_url, max_connections=concurrency) as client:

        async def worker() -> None:
            for n in counter:
                episode_id = (await client.create(task_id=task_ids[n % len(task_ids)])).episode_id
                for _ in range(3):
                    await client.step(episode_id, action)
                await client.close(episode_id)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="textcraft", choices=sorted(STEADY_ACTION))
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="steps per concurrent episode")
    parser.add_argument("--live", type=int, default=256)
    parser.add_argument("--episodes", type=int, default=10_000, help="episodes for the leak check")
    parser.add_argument("--skip", nargs="*", default=[], choices=["overhead", "live", "leak"])
    args = parser.parse_args()

    env = args.env
    action = STEADY_ACTION[env]
    catalog = environment_class(env).catalog()
    task_ids = list(catalog.task_ids("test"))
    task_id = task_ids[0]
    print(f"# environment service benchmark: {env}, pid {os.getpid()}, {os.cpu_count()} CPUs")

    with service(env, max_episodes=max(args.live, args.concurrent) + 16) as svc:
        if "overhead" not in args.skip:
            base = in_process_step_seconds(env, task_id, action, args.concurrent * args.steps)
            base_p50 = statistics.median(base)
            total_steps = args.concurrent * args.steps
            asyncio.run(http_concurrent(svc, task_id, action, args.concurrent, 10))  # warm-up
            print(f"in-process step ({action!r}): p50 {base_p50 * 1e3:.3f} ms")
            for label, run in (("HTTP", http_concurrent), ("gRPC", grpc_concurrent)):
                cpu_before = svc.cpu_seconds()
                wall, lat = asyncio.run(run(svc, task_id, action, args.concurrent, args.steps))
                server_cpu = (svc.cpu_seconds() - cpu_before) / total_steps
                per_step = wall / total_steps
                print(
                    f"{label} x{args.concurrent} episodes, {total_steps} steps: {total_steps / wall:,.0f} steps/s; "
                    f"per-step overhead: wall {(per_step - base_p50) * 1e3:.3f} ms, service CPU "
                    f"{(server_cpu - base_p50) * 1e3:.3f} ms (client shares the 2 cores); latency p50 "
                    f"{percentile(lat, 0.5) * 1e3:.2f} ms, p95 {percentile(lat, 0.95) * 1e3:.2f} ms "
                    f"(queueing behind {args.concurrent - 1} others)"
                )
            seq = asyncio.run(sequential_http(svc, task_id, action, 500))
            print(
                f"HTTP sequential, one client: latency p50 {percentile(seq, 0.5) * 1e3:.3f} ms -> overhead "
                f"{(percentile(seq, 0.5) - base_p50) * 1e3:.3f} ms over in-process "
                f"({percentile(seq, 0.5) / base_p50:.0f}x the step itself)"
            )
        if "live" not in args.skip:
            idle = svc.rss_mib()
            rss = asyncio.run(live_episodes(svc, task_ids, args.live, action))
            print(
                f"RSS idle {idle:.0f} MiB; with {args.live} live episodes {rss:.0f} MiB "
                f"({(rss - idle) * 1024 / args.live:.0f} KiB per episode; target <= 1024 MiB total)"
            )

    if "leak" not in args.skip:
        with service(env, max_episodes=64) as svc:
            first = max(args.episodes // 10, 1)
            asyncio.run(churn(svc, task_ids, action, first))
            rss_first = svc.rss_mib()
            started = time.perf_counter()
            asyncio.run(churn(svc, task_ids, action, args.episodes - first))
            rss_all = svc.rss_mib()
            rate = (args.episodes - first) / (time.perf_counter() - started)
            print(
                f"RSS after {first:,} episodes {rss_first:.1f} MiB; after {args.episodes:,} {rss_all:.1f} MiB "
                f"({(rss_all / rss_first - 1) * 100:+.1f} %, target <= +10 %); {rate:.0f} episodes/s"
            )


if __name__ == "__main__":
    main()
