"""SciWorld service figures against baselines measured in the same run.

1. Step rate of one slot: the `scienceworld` wheel's `ScienceWorldEnv.step()` (stock JVM, as
   AgentGym runs it) against `SciWorldEnv.step` on a pool slot, on the same action sequences
   (gold paths of test variations), in alternating rounds so machine noise hits both alike.
2. Warm-up: a pool of 1 slot against a pool of 8 (JVMs started in parallel threads), wall time and
   the JVMs' CPU seconds (the figure that bounds the ratio on a machine with few cores).
3. Memory: one slot's resident memory (RSS of its JVM) over N episodes, sampled every 50.

Run from the repository root: ``.venv/bin/python benchmarks/sciworld_bench.py [--episodes 500]``.
Parts can be chosen with ``--only step,warmup,memory``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from agentgym.envs.sciworld.env import SciWorldEnv, pool_settings
from agentgym.envs.sciworld.expert import SciWorldExpert
from agentgym.envs.sciworld.jvm import JVMSettings, build_cds_archive
from agentgym.envs.sciworld.pool import SciWorldPool
from agentgym.envs.sciworld.tasks import load_catalog

# Test variations of short and long tasks (2 per kind would take minutes of gold-path generation).
STEP_TASKS = [
    "boil/v21",
    "use-thermometer/v440",
    "power-component/v15",
    "test-conductivity/v786",
    "find-living-thing/v281",
    "chemistry-mix/v24",
    "lifespan-longest-lived/v100",
    "identify-life-stages-1/v9",
]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench_step(rounds: int) -> dict[str, float]:
    from scienceworld import ScienceWorldEnv

    print(f"== step rate: wheel env.step() vs SciWorldEnv.step, {len(STEP_TASKS)} gold paths x {rounds} rounds")
    pool = SciWorldPool(pool_settings(pool_size=1))
    expert = SciWorldExpert(pool=pool)
    env = SciWorldEnv(pool=pool)
    catalog = load_catalog()
    golds = {task_id: expert.demonstrate(task_id) for task_id in STEP_TASKS}
    stock = ScienceWorldEnv()  # the wheel's own JVM launch, as AgentGym uses it
    stock_pid = stock._gateway.java_process.pid

    def run_stock() -> int:
        steps = 0
        for task_id, gold in golds.items():
            info = catalog.info(task_id)
            stock.load(info.task_name, info.variation)
            stock.step("look around")
            for action in gold:
                _, _, done, _ = stock.step(action)
                steps += 1
                if done:
                    break
        return steps

    def run_fast() -> int:
        steps = 0
        for task_id, gold in golds.items():
            env.reset(task_id)
            for action in gold:
                steps += 1
                if env.step(action).done:
                    break
        return steps

    def timed(fn: Callable[[], int]) -> tuple[int, float]:
        began = time.perf_counter()
        steps = fn()
        return steps, time.perf_counter() - began

    # Reset time is part of both loops; subtract it by timing the loads alone.
    def run_loads(load: Callable[[str], Any]) -> int:
        for task_id in golds:
            load(task_id)
        return 0

    def stock_load(task_id: str) -> None:
        info = catalog.info(task_id)
        stock.load(info.task_name, info.variation)
        stock.step("look around")

    timed(run_stock)  # JIT warm-up of both JVMs
    timed(run_fast)
    stock_rates, fast_rates = [], []
    for _ in range(rounds):
        n, seconds = timed(run_stock)
        _, load_s = timed(lambda: run_loads(stock_load))
        stock_rates.append(n / max(seconds - load_s, 1e-9))
        n, seconds = timed(run_fast)
        _, load_s = timed(lambda: run_loads(env.reset))
        fast_rates.append(n / max(seconds - load_s, 1e-9))
    stock_rate, fast_rate = statistics.median(stock_rates), statistics.median(fast_rates)
    steps = sum(len(g) for g in golds.values())
    print(f"  actions per round          {steps} (replayed until done)")
    print(f"  wheel env.step()           {stock_rate:8.1f} steps/s  (JVM RSS {_rss_mb(stock_pid):.0f} MB)")
    print(f"  SciWorldEnv.step (slot)    {fast_rate:8.1f} steps/s  (JVM RSS {_rss_mb(env.jvm_pid or 0):.0f} MB)")
    print(f"  ratio                      {fast_rate / stock_rate:8.2f}x  (target >= 3x)")
    began = time.perf_counter()
    for _ in range(20):
        env.available_actions()
    print(f"  valid actions on request   {(time.perf_counter() - began) / 20 * 1000:8.1f} ms per call")
    env.close()
    stock.close()
    pool.close()
    return {"stock_steps_per_s": stock_rate, "fast_steps_per_s": fast_rate, "ratio": fast_rate / stock_rate}


def bench_warmup(sizes: tuple[int, ...] = (1, 2, 8)) -> dict[str, float]:
    print(f"== warm-up: pools of {', '.join(map(str, sizes))} slots (JVM start + one world loaded)")
    build_cds_archive(JVMSettings())
    results: dict[str, float] = {}
    for size in sizes:
        pool = SciWorldPool(pool_settings(pool_size=size))
        seconds = pool.wait_warm(timeout=600)
        cpu = sum(_cpu_seconds(slot.jvm.pid) for slot in pool.slots())
        rss = [_rss_mb(slot.jvm.pid) for slot in pool.slots()]
        pool.close()
        results[f"warm_{size}_s"] = seconds
        print(
            f"  {size} slot(s)   {seconds:6.2f} s wall   {cpu / size:5.2f} CPU-s per JVM   "
            f"RSS per slot {statistics.mean(rss):.0f} MB"
        )
        time.sleep(1)
    first = sizes[0]
    for size in sizes[1:]:
        ratio = results[f"warm_{size}_s"] / results[f"warm_{first}_s"]
        results[f"ratio_{size}"] = ratio
        print(
            f"  ratio {size}/{first}          {ratio:6.2f}x  (target for 8: <= 1.5x; {os.cpu_count()} CPU cores here)"
        )
    return results


def bench_memory(episodes: int, steps: int = 5) -> dict[str, float]:
    print(f"== memory: one slot over {episodes} episodes ({steps} random valid actions each)")
    pool = SciWorldPool(pool_settings(pool_size=1))
    catalog = load_catalog()
    rng = random.Random(7)
    test = catalog.task_ids("test")
    samples: list[tuple[int, float]] = []
    env = SciWorldEnv(pool=pool)
    began = time.perf_counter()
    for episode in range(1, episodes + 1):
        env.reset(rng.choice(test))
        for _ in range(steps):
            actions = env.available_actions() or ["look around"]
            if env.step(rng.choice(actions)).done:
                break
        if episode % 50 == 0 or episode == 1:
            samples.append((episode, _rss_mb(env.jvm_pid or 0)))
    elapsed = time.perf_counter() - began
    env.close()
    pool.close()
    line = "  ".join(f"{n}:{rss:.0f}" for n, rss in samples)
    print(f"  RSS MB by episode  {line}")
    settled = [rss for n, rss in samples if n >= 50]
    base = settled[0]
    spread = (max(settled) - min(settled)) / base
    print(f"  after warm-up      {base:.0f} MB at episode 50, max {max(settled):.0f} MB, last {settled[-1]:.0f} MB")
    print(
        f"  drift              {100 * (settled[-1] - base) / base:+.1f} % (spread {100 * spread:.1f} %; target +-10 %)"
    )
    print(f"  episodes/s         {episodes / elapsed:.1f}")
    return {"rss_50_mb": base, "rss_max_mb": max(settled), "rss_last_mb": settled[-1], "spread": spread}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="step,warmup,memory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=500)
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    print(f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}")
    if "step" in parts:
        bench_step(args.rounds)
    if "warmup" in parts:
        bench_warmup()
    if "memory" in parts:
        bench_memory(args.episodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
