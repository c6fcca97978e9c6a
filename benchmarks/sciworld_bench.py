"""SciWorld service figures against baselines measured in the same run.

1. Step rate of one slot: the `scienceworld` wheel's `ScienceWorldEnv.step()` (stock JVM, as
   AgentGym runs it) against `SciWorldEnv.step` on a pool slot, on the same action sequences
   (gold paths of test variations), in alternating rounds so machine noise hits both alike. Then
   the rate per slot when 8 slots step at once, sharing one JVM (the default) against 8 JVMs of
   their own (`simulators_per_jvm=1`).
2. Warm-up: a pool of 1 slot against pools of 8 (the default: one JVM hosting 8 simulators; also
   2 JVMs of 4, and 8 JVMs of 1 as before), wall time and the JVMs' CPU seconds (the figure that
   bounds the ratio on a machine with few cores), in interleaved rounds (medians reported).
3. Memory: resident memory per slot (RSS of the JVM / slots on it) over N episodes per slot,
   sampled every 50, for 8 slots sharing one JVM (episodes round-robin over the slots), or one
   slot alone with ``--memory-slots 1``.

Run from the repository root: ``.venv/bin/python benchmarks/sciworld_bench.py [--episodes 500]``.
Parts can be chosen with ``--only step,shared,warmup,memory``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
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


def _gold_paths(pool: SciWorldPool) -> dict[str, list[str]]:
    expert = SciWorldExpert(pool=pool)
    return {task_id: expert.demonstrate(task_id) for task_id in STEP_TASKS}


def _replay(env: SciWorldEnv, golds: dict[str, list[str]]) -> tuple[int, float]:
    """Replay every gold path until done; (steps, seconds spent in steps, resets excluded)."""
    steps, seconds = 0, 0.0
    for task_id, gold in golds.items():
        env.reset(task_id)
        began = time.perf_counter()
        for action in gold:
            steps += 1
            if env.step(action).done:
                break
        seconds += time.perf_counter() - began
    return steps, seconds


def _replay_into(env: SciWorldEnv, golds: dict[str, list[str]], rates: list[float]) -> None:
    steps, seconds = _replay(env, golds)
    rates.append(steps / seconds)


def bench_step(rounds: int) -> dict[str, float]:
    from scienceworld import ScienceWorldEnv

    print(f"== step rate: wheel env.step() vs SciWorldEnv.step, {len(STEP_TASKS)} gold paths x {rounds} rounds")
    pool = SciWorldPool(pool_settings(pool_size=1))
    env = SciWorldEnv(pool=pool)
    catalog = load_catalog()
    golds = _gold_paths(pool)
    stock = ScienceWorldEnv()  # the wheel's own JVM launch, as AgentGym uses it
    stock_pid = stock._gateway.java_process.pid

    def run_stock() -> tuple[int, float]:
        steps, seconds = 0, 0.0
        for task_id, gold in golds.items():
            info = catalog.info(task_id)
            stock.load(info.task_name, info.variation)
            stock.step("look around")
            began = time.perf_counter()
            for action in gold:
                _, _, done, _ = stock.step(action)
                steps += 1
                if done:
                    break
            seconds += time.perf_counter() - began
        return steps, seconds

    run_stock()  # JIT warm-up of both JVMs
    _replay(env, golds)
    stock_rates, fast_rates = [], []
    for _ in range(rounds):
        n, seconds = run_stock()
        stock_rates.append(n / seconds)
        n, seconds = _replay(env, golds)
        fast_rates.append(n / seconds)
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


def bench_shared_steps(rounds: int, slots: int = 8) -> dict[str, float]:
    """Per-slot step rate with `slots` episodes stepping at once: one shared JVM vs a JVM each.

    Each slot replays the gold paths in its own thread; its rate is its steps over the time its
    steps took (waiting for the JVM included, its resets excluded), the median over slots and rounds.
    """
    print(f"== step rate per slot, {slots} slots replaying at once (a thread each), {rounds} rounds")
    results: dict[str, float] = {}
    for label, per_jvm in (("one JVM of 8", slots), ("8 JVMs of 1", 1)):
        pool = SciWorldPool(pool_settings(pool_size=slots, simulators_per_jvm=per_jvm))
        pool.wait_warm(timeout=600)
        golds = _gold_paths(pool)
        envs = [SciWorldEnv(pool=pool) for _ in range(slots)]
        for env in envs:
            _replay(env, golds)  # every simulator's JIT warm
        rates: list[float] = []
        for _ in range(rounds):
            threads = [threading.Thread(target=_replay_into, args=(env, golds, rates)) for env in envs]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        alone: list[float] = []
        for _ in range(rounds):
            steps, seconds = _replay(envs[0], golds)
            alone.append(steps / seconds)
        rate, alone_rate = statistics.median(rates), statistics.median(alone)
        pids = {env.jvm_pid for env in envs}
        print(
            f"  {label:13s} {rate:7.1f} steps/s per slot with {slots} stepping ({rate * slots:6.1f} in all); "
            f"one slot stepping alone {alone_rate:6.1f}/s; {len(pids)} JVM(s)"
        )
        results[f"per_slot_{per_jvm}"] = rate
        results[f"alone_{per_jvm}"] = alone_rate
        for env in envs:
            env.close()
        pool.close()
    return results


def _warm(size: int, per_jvm: int) -> tuple[float, float, float]:
    """(wall seconds, CPU-s of all JVMs, RSS MB per slot) for a pool of `size` slots to warm up."""
    pool = SciWorldPool(pool_settings(pool_size=size, simulators_per_jvm=per_jvm))
    seconds = pool.wait_warm(timeout=600)
    pids = {slot.jvm.pid for slot in pool.slots()}
    cpu = sum(_cpu_seconds(pid) for pid in pids)
    rss = sum(_rss_mb(pid) for pid in pids) / size
    pool.close()
    return seconds, cpu, rss


def bench_warmup(rounds: int) -> dict[str, float]:
    configs = [(1, 1), (8, 8), (8, 4), (8, 1)]
    names = {(1, 1): "1 slot", (8, 8): "8 slots, 1 JVM of 8", (8, 4): "8 slots, 2 JVMs of 4", (8, 1): "8 slots, 8 JVMs"}
    print(f"== warm-up: pools of 1 and 8 slots (JVM start + first world), {rounds} interleaved rounds")
    build_cds_archive(JVMSettings())
    samples: dict[tuple[int, int], list[tuple[float, float, float]]] = {config: [] for config in configs}
    for _ in range(rounds):
        for config in configs:
            samples[config].append(_warm(*config))
            time.sleep(0.5)
    results: dict[str, float] = {}
    base_wall = statistics.median(s[0] for s in samples[(1, 1)])
    base_cpu = statistics.median(s[1] for s in samples[(1, 1)])
    for config in configs:
        wall = statistics.median(s[0] for s in samples[config])
        cpu = statistics.median(s[1] for s in samples[config])
        rss = statistics.median(s[2] for s in samples[config])
        # The ratio of medians, and the median of each round's own ratio (noise hits a round alike).
        per_round = statistics.median(s[0] / b[0] for s, b in zip(samples[config], samples[(1, 1)], strict=True))
        results[f"warm_{config[0]}x{config[1]}_s"] = wall
        line = f"  {names[config]:22s} {wall:5.2f} s wall  {cpu:5.2f} CPU-s  RSS/slot {rss:4.0f} MB"
        if config != (1, 1):
            results[f"ratio_{config[0]}x{config[1]}"] = wall / base_wall
            line += f"  ratio {wall / base_wall:4.2f}x (per round {per_round:4.2f}x; CPU {cpu / base_cpu:4.2f}x)"
        print(line + f"  walls {[round(s[0], 2) for s in samples[config]]}")
    print(f"  target: 8 slots <= 1.5x one slot; {os.cpu_count()} CPU cores here, load {os.getloadavg()[0]:.1f}")
    return results


def bench_memory(episodes: int, slots: int, steps: int = 5) -> dict[str, float]:
    print(
        f"== memory: {slots} slot(s) in one JVM, {episodes} episodes each, round-robin "
        f"({steps} random actions each, from the valid ones at its start)"
    )
    pool = SciWorldPool(pool_settings(pool_size=slots, simulators_per_jvm=slots))
    pool.wait_warm(timeout=600)
    catalog = load_catalog()
    rng = random.Random(7)
    test = catalog.task_ids("test")
    samples: list[tuple[int, float]] = []
    envs = [SciWorldEnv(pool=pool) for _ in range(slots)]
    began = time.perf_counter()
    for episode in range(1, episodes + 1):
        for env in envs:
            env.reset(rng.choice(test))
            actions = env.available_actions() or ["look around"]  # once: ~80 ms a call
            for _ in range(steps):
                if env.step(rng.choice(actions)).done:
                    break
        if episode % 50 == 0 or episode == 1:
            samples.append((episode, _rss_mb(envs[0].jvm_pid or 0) / slots))
    elapsed = time.perf_counter() - began
    pids = {env.jvm_pid for env in envs}
    for env in envs:
        env.close()
    pool.close()
    assert len(pids) == 1, pids
    line = "  ".join(f"{n}:{rss:.0f}" for n, rss in samples)
    print(f"  RSS MB per slot by episode  {line}")
    settled = [rss for n, rss in samples if n >= 100]
    base = settled[0]
    spread = (max(settled) - min(settled)) / base
    print(f"  after warm-up      {base:.0f} MB per slot at episode 100, max {max(settled):.0f}, last {settled[-1]:.0f}")
    print(
        f"  drift              {100 * (settled[-1] - base) / base:+.1f} % (spread {100 * spread:.1f} %; target +-10 %)"
    )
    print(f"  episodes/s         {episodes * slots / elapsed:.1f} (all slots)")
    return {"rss_100_mb": base, "rss_max_mb": max(settled), "rss_last_mb": settled[-1], "spread": spread}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="step,shared,warmup,memory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-rounds", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=500, help="memory: episodes per slot")
    parser.add_argument("--memory-slots", type=int, default=8)
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    print(f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}")
    benches: list[tuple[str, Callable[[], Any]]] = [
        ("step", lambda: bench_step(args.rounds)),
        ("shared", lambda: bench_shared_steps(args.rounds)),
        ("warmup", lambda: bench_warmup(args.warmup_rounds)),
        ("memory", lambda: bench_memory(args.episodes, args.memory_slots)),
    ]
    for name, bench in benches:
        if name in parts:
            bench()
    return 0


if __name__ == "__main__":
    sys.exit(main())
