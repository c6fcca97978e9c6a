"""WebArena (browser) environment figures, against baselines measured in the same run.

1. Reset latency: `WebArenaEnv.reset` on MiniWoB++ tasks (a spare context, the task page, seeded)
   against the BrowserGym way (a fresh Chromium launched for the episode, then the same page).
2. Step rate on MiniWoB click tasks: `WebArenaEnv.step("click [id]")` (mouse click, settle, a new
   accessibility tree, the task's reward) against a bare Playwright loop on the same page (CDP
   click position + mouse click + the raw AX tree, no settling): the cost of the observation/
   settle layer.
3. Memory per extra live episode: PSS (proportional set size: shared pages counted once) of every
   Chromium process, with 1 live episode and with 1 + N, (PSS_N - PSS_1) / N.
4. Concurrency: 16 episodes of one service process (the episode manager, as the HTTP and gRPC front
   ends drive it) stepping concurrently: aggregate steps/s, failures.

Run from the repository root: ``.venv/bin/python benchmarks/webarena_bench.py [--only reset,step,memory,concurrency]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from playwright.async_api import async_playwright

from agentgym.envs.server.manager import EpisodeManager, ManagerConfig
from agentgym.envs.webarena.browser import BrowserSettings, shared_host
from agentgym.envs.webarena.env import WebArenaEnv
from agentgym.envs.webarena.miniwob import START_JS, MiniWoBTask, shared_task_server, tree_lines


def _pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def chromium_pss_mb() -> float:
    host = shared_host()
    return sum(_pss_mb(pid) for pid in host.call(host.process_ids, 30))


def checkbox_ids(observation: str) -> list[int]:
    return [line.node_id for line in tree_lines(observation) if line.role == "checkbox"]


def bench_reset(rounds: int) -> None:
    env = WebArenaEnv()
    env.reset("miniwob/click-button/0")  # browser launch, spare context
    ours: list[float] = []
    for seed in range(rounds):
        started = time.perf_counter()
        env.reset(f"miniwob/{('click-button', 'enter-text', 'click-checkboxes')[seed % 3]}/{seed}")
        ours.append(time.perf_counter() - started)
    env.close()

    server = shared_task_server()
    settings = BrowserSettings()

    async def browsergym_style(seed: int) -> float:
        started = time.perf_counter()
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=settings.chromium(), args=settings.args())
            page = await (await browser.new_context()).new_page()
            await page.goto(server.url(MiniWoBTask("click-button", seed)))
            await page.evaluate(START_JS, [str(seed)])
            elapsed = time.perf_counter() - started
            await browser.close()
        return elapsed

    baseline = [asyncio.run(browsergym_style(seed)) for seed in range(max(3, rounds // 4))]
    p50, base = statistics.median(ours), statistics.median(baseline)
    print(f"reset p50: {p50 * 1000:.0f} ms (p90 {sorted(ours)[int(0.9 * len(ours))] * 1000:.0f} ms, n={len(ours)})")
    print(
        f"  baseline (fresh Chromium per episode, BrowserGym-style): {base * 1000:.0f} ms -> {base / p50:.1f}x faster"
    )


def bench_step(steps: int) -> None:
    env = WebArenaEnv()
    first = env.reset("miniwob/click-checkboxes/3")
    boxes = checkbox_ids(first.observation)
    started = time.perf_counter()
    for index in range(steps):
        result = env.step(f"click [{boxes[index % len(boxes)]}]")
        assert not result.info["invalid_action"] and not result.done, result.observation[:200]
    ours = steps / (time.perf_counter() - started)
    env.close()

    host = shared_host()
    server = shared_task_server()

    async def bare_loop() -> float:
        context, _ = await host.new_context()
        page = await context.new_page()
        await page.goto(server.url(MiniWoBTask("click-checkboxes", 3)))
        await page.evaluate(START_JS, ["3"])
        cdp = await context.new_cdp_session(page)
        tree = await cdp.send("Accessibility.getFullAXTree")
        ids = [n["backendDOMNodeId"] for n in tree["nodes"] if n.get("role", {}).get("value") == "checkbox"]
        begun = time.perf_counter()
        for index in range(steps):
            quads = await cdp.send("DOM.getContentQuads", {"backendNodeId": ids[index % len(ids)]})
            quad = quads["quads"][0]
            await page.mouse.click(sum(quad[0::2]) / 4, sum(quad[1::2]) / 4)
            await cdp.send("Accessibility.getFullAXTree")
        rate = steps / (time.perf_counter() - begun)
        await context.close()
        return rate

    bare = host.call(bare_loop, 300)
    print(f"steps/s on a MiniWoB click task: {ours:.1f} (n={steps}; {1000 / ours:.0f} ms per step)")
    print(
        f"  bare Playwright click + raw AX tree (no settling, no rendering, no reward): {bare:.1f}/s; "
        f"settle + observation + reward cost {1000 / ours - 1000 / bare:.0f} ms per step"
    )


def bench_memory(extra: int) -> None:
    first = WebArenaEnv()
    first.reset("miniwob/click-checkboxes/1")
    one = chromium_pss_mb()
    envs = []
    for seed in range(extra):
        env = WebArenaEnv()
        env.reset(f"miniwob/{('click-button', 'enter-text', 'click-checkboxes', 'login-user')[seed % 4]}/{seed}")
        envs.append(env)
    many = chromium_pss_mb()
    per_episode = (many - one) / extra
    print(f"Chromium PSS: {one:.0f} MB with 1 live episode, {many:.0f} MB with {1 + extra}")
    print(f"  per extra live episode: {per_episode:.1f} MB")
    for env in [first, *envs]:
        env.close()


async def _concurrency(episodes: int, steps: int) -> None:
    manager = EpisodeManager(
        "webarena", WebArenaEnv, WebArenaEnv.catalog(), ManagerConfig(max_episodes=episodes + 4, worker_threads=32)
    )
    await manager.start()
    failures = 0

    async def one(index: int) -> int:
        episode, first = await manager.open(f"miniwob/click-checkboxes/{index}")
        assert first is not None
        boxes = checkbox_ids(first.observation)
        for step in range(steps):
            result = await manager.step(episode.episode_id, f"click [{boxes[step % len(boxes)]}]")
            if result.info.get("failed"):
                return 1
        await manager.close(episode.episode_id)
        return 0

    started = time.perf_counter()
    results: list[Any] = await asyncio.gather(*(one(i) for i in range(episodes)), return_exceptions=True)
    elapsed = time.perf_counter() - started
    failures = sum(1 if isinstance(r, BaseException) else r for r in results)
    await manager.stop()
    print(
        f"{episodes} concurrent episodes x {steps} steps: {episodes * steps / elapsed:.1f} steps/s aggregate, "
        f"{elapsed:.1f} s incl. resets, failed episodes: {failures}"
    )
    for result in results:
        if isinstance(result, BaseException):
            print(f"  error: {result!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="reset,step,memory,concurrency")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--extra-episodes", type=int, default=8)
    parser.add_argument("--concurrent", type=int, default=16)
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if "reset" in parts:
        bench_reset(args.rounds)
    if "step" in parts:
        bench_step(args.steps)
    if "memory" in parts:
        bench_memory(args.extra_episodes)
    if "concurrency" in parts:
        asyncio.run(_concurrency(args.concurrent, 20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
