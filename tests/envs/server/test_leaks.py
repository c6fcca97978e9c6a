"""Short leak test: thousands of create/step/close cycles leave no episode, no instance, no growth."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import httpx

from agentgym.envs.base import Environment
from agentgym.envs.server.http_api import create_app
from agentgym.envs.server.manager import EpisodeManager, ManagerConfig
from agentgym.envs.textcraft.env import TextCraftEnv


async def _cycle(client: httpx.AsyncClient, task_ids: list[str], count: int) -> None:
    for n in range(count):
        created = await client.post("/v1/episodes", json={"task_id": task_ids[n % len(task_ids)]})
        episode_id = created.json()["episode_id"]
        for action in ("inventory", "get 1 stick", "nonsense"):
            assert (await client.post(f"/v1/episodes/{episode_id}/step", json={"action": action})).status_code == 200
        assert (await client.delete(f"/v1/episodes/{episode_id}")).status_code == 204


async def test_closed_episodes_release_everything() -> None:
    alive: weakref.WeakSet[Environment] = weakref.WeakSet()

    def factory() -> Environment:
        env = TextCraftEnv()
        alive.add(env)
        return env

    catalog = TextCraftEnv.catalog()
    task_ids = list(catalog.task_ids("test"))
    manager = EpisodeManager("textcraft", factory, catalog, ManagerConfig(max_episodes=8, worker_threads=2))
    await manager.start()
    app = create_app(manager, compat=False, manage_lifecycle=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env") as client:
        tracemalloc.start()
        # Warm-up fills bounded caches (catalog, reset texts, URL parsing); a leak keeps growing after.
        await _cycle(client, task_ids, 300)
        gc.collect()
        before = _live_blocks(tracemalloc.take_snapshot())
        await _cycle(client, task_ids, 1200)
        gc.collect()
        after = _live_blocks(tracemalloc.take_snapshot())
        tracemalloc.stop()
    await manager.stop()
    gc.collect()
    assert manager.live_episodes == 0
    assert len(alive) == 0, f"{len(alive)} environment instances still referenced after close"
    # Leaking even one object per episode would add >= 1,200 live blocks; bounded caches add a few hundred.
    assert after - before < 600, f"{after - before} more live allocations after 1,200 more episodes"


def _live_blocks(snapshot: tracemalloc.Snapshot) -> int:
    return sum(stat.count for stat in snapshot.statistics("filename"))
