"""The episode manager's thread budget: every live episode's call runs at once, none queues behind another's."""

from __future__ import annotations

import asyncio
import threading

from countdown_env import CountdownCatalog, CountdownEnv

from agentgym.envs.base import StepResult
from agentgym.envs.server.manager import EpisodeManager, ManagerConfig

EPISODES = 6


class RendezvousEnv(CountdownEnv):
    """A step returns only once every episode is inside a step: like episodes that wait on a resource another
    episode's call holds (ScienceWorld slots, a browser)."""

    barrier = threading.Barrier(EPISODES, timeout=10)

    def step(self, action: str) -> StepResult:
        RendezvousEnv.barrier.wait()
        return super().step(action)


def test_by_default_the_manager_has_a_thread_for_every_live_episode() -> None:
    assert ManagerConfig(max_episodes=48).threads == 48
    assert ManagerConfig(max_episodes=48, worker_threads=4).threads == 4


async def test_every_live_episode_steps_at_once_with_the_default_threads() -> None:
    """With fewer threads than episodes the waiting steps hold every thread, the last episodes' steps queue
    behind them and all of them time out; with one thread per episode they all meet and finish."""
    RendezvousEnv.barrier.reset()
    manager = EpisodeManager("countdown", RendezvousEnv, CountdownCatalog(), ManagerConfig(max_episodes=EPISODES))
    await manager.start()
    try:
        episodes = [(await manager.open("count/1"))[0] for _ in range(EPISODES)]
        results = await asyncio.gather(*(manager.step(e.episode_id, "tick") for e in episodes))
        assert [r.done for r in results] == [True] * EPISODES
        assert not any(r.info.get("error") for r in results)
    finally:
        await manager.stop()
