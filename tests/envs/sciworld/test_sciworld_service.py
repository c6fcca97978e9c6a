"""The SciWorld service over HTTP (native /v1 and AgentGym's routes), with real ScienceWorld JVMs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentgym.envs import make_expert
from agentgym.envs.sciworld.env import pool_settings
from agentgym.envs.sciworld.pool import close_shared_pools, shared_pool
from agentgym.envs.sciworld.tasks import load_catalog
from agentgym.envs.server.http_api import create_app
from agentgym.envs.server.manager import EpisodeManager, ManagerConfig
from agentgym.envs.server.runner import build_manager

# Three slots, two per JVM: a JVM shared by two episodes, and another one.
SETTINGS: dict[str, Any] = {"pool_size": 3, "warm_slots": 1, "simulators_per_jvm": 2}
catalog = load_catalog()


@pytest.fixture(scope="module", autouse=True)
def _close_pools() -> Any:
    yield
    close_shared_pools()


async def _service(step_timeout_s: float = 20.0) -> tuple[EpisodeManager, httpx.AsyncClient]:
    config = ManagerConfig(max_episodes=8, step_timeout_s=step_timeout_s, worker_threads=4)
    manager = build_manager("sciworld", config, SETTINGS)
    await manager.start()
    transport = httpx.ASGITransport(app=create_app(manager, manage_lifecycle=False))
    return manager, httpx.AsyncClient(transport=transport, base_url="http://env", timeout=300)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    manager, http = await _service()
    async with http:
        yield http
    await manager.stop()


def _slot_gone(pid: int) -> bool:
    return pid not in shared_pool(pool_settings(**SETTINGS)).stats()["pids"]


async def _eventually(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        stats = shared_pool(pool_settings(**SETTINGS)).stats()
        assert time.monotonic() < deadline, f"condition not reached in {timeout:g}s (pool: {stats})"
        await asyncio.sleep(0.05)


# -- AgentGym routes ---------------------------------------------------------------------------


async def test_agentgym_episode(client: httpx.AsyncClient) -> None:
    assert (await client.get("/")).text == "This is environment ScienceWorld."
    created = await client.post("/create")
    assert created.status_code == 200 and set(created.json()) == {"id"}
    number = created.json()["id"]

    reset = (await client.post("/reset", json={"id": number, "data_idx": 0})).json()
    assert reset["task_name"] == "boil" and reset["var_num"] == 0
    assert reset["task_description"].startswith("Your task is to boil water.")
    assert reset["observation"].startswith("This room is called the hallway.")
    assert (reset["reward"], reset["score"], reset["done"], reset["deleted"]) == (0, 0, False, False)
    assert (await client.get("/observation", params={"id": number})).json() == reset["observation"]

    step = (await client.post("/step", json={"id": number, "action": "open door to kitchen"})).json()
    assert set(step) == {"observation", "reward", "score", "done"}
    assert step["observation"] == "The door is now open."
    assert step["done"] is False and step["score"] == step["reward"] >= 0
    assert (await client.get("/observation", params={"id": number})).json() == "The door is now open."

    hint = (await client.get("/action_hint", params={"id": number})).json()
    assert "focus on OBJ" in hint["possible_actions"] and "door to kitchen" in hint["possible_objects"]
    goals = (await client.get("/goals", params={"id": number})).json()
    assert isinstance(goals["goals"], str) and goals["goals"]

    # data_idx follows AgentGym's task list (120 = use-thermometer variation 0)
    again = (await client.post("/reset", json={"id": number, "data_idx": 120})).json()
    assert (again["task_name"], again["var_num"]) == ("use-thermometer", 0)

    closed = await client.post("/close", json={"id": number})
    assert closed.status_code == 200 and closed.json() == {"id": number, "closed": True}
    gone = await client.post("/step", json={"id": number, "action": "look around"})
    assert gone.status_code == 404 and "no live episode" in gone.json()["error"]


async def test_agentgym_errors(client: httpx.AsyncClient) -> None:
    for response in (
        await client.post("/step", json={"id": 999, "action": "look around"}),
        await client.post("/reset", json={"id": 999, "data_idx": 0}),
        await client.get("/observation", params={"id": 999}),
        await client.get("/action_hint", params={"id": 999}),
        await client.post("/close", json={"id": 999}),
    ):
        assert response.status_code == 404, response.text
        assert response.json()["error"] == response.json()["detail"]
    number = (await client.post("/create")).json()["id"]
    early = await client.post("/step", json={"id": number, "action": "look around"})
    assert early.status_code == 409 and "no task yet" in early.json()["error"]
    assert (await client.get("/action_hint", params={"id": number})).status_code == 409
    assert (await client.get("/observation", params={"id": number})).status_code == 409
    out_of_range = await client.post("/reset", json={"id": number, "data_idx": 4639})
    assert out_of_range.status_code == 404 and "out of range" in out_of_range.json()["error"]
    await client.post("/reset", json={"id": number, "data_idx": 21})  # boil/v21
    bad = (await client.post("/step", json={"id": number, "action": "dance wildly"})).json()
    assert bad == {"observation": "No known action matches that input.", "reward": 0.0, "score": 0.0, "done": False}
    failed = (await client.post("/step", json={"id": number, "action": "focus on agent"})).json()
    assert failed["done"] is True and failed["score"] == 0.0  # ScienceWorld's -100: a failed task
    after = await client.post("/step", json={"id": number, "action": "look around"})
    assert after.status_code == 409 and "over" in after.json()["error"]
    malformed = await client.post("/step", json={"id": "first", "action": "look around"})
    assert malformed.status_code == 422


# -- native API --------------------------------------------------------------------------------


async def test_native_episode_and_tasks(client: httpx.AsyncClient) -> None:
    tasks = (await client.get("/v1/tasks", params={"split": "test", "limit": 2})).json()
    assert tasks["splits"]["test"] == 1171 and tasks["task_ids"] == ["boil/v21", "boil/v22"]
    described = (await client.get("/v1/tasks/boil/v21")).json()
    assert described["task_number"] == "1-1" and described["split"] == "test"
    assert (await client.get("/v1/tasks/boil/v99")).status_code == 404
    assert (await client.post("/v1/episodes", json={"task_id": "boil/v99"})).status_code == 404

    created = await client.post("/v1/episodes", json={"split": "test", "index": 0})
    assert created.status_code == 201
    body = created.json()
    assert body["task_id"] == "boil/v21" and body["observation"].startswith("Your task is to boil lead.")
    assert body["available_actions"] is None
    eid = body["episode_id"]
    actions = (await client.get(f"/v1/episodes/{eid}/actions")).json()["available_actions"]
    assert "open door" in actions and len(actions) > 100
    step = (await client.post(f"/v1/episodes/{eid}/step", json={"action": "open door to kitchen"})).json()
    assert step["observation"] == "The door is now open." and step["info"]["invalid_action"] is False
    assert step["available_actions"] is None
    observed = (await client.get(f"/v1/episodes/{eid}")).json()
    assert observed["status"] == "running" and observed["steps"] == 1
    assert (await client.delete(f"/v1/episodes/{eid}")).status_code == 204
    assert (await client.post(f"/v1/episodes/{eid}/step", json={"action": "look around"})).status_code == 404
    assert (await client.get("/v1/episodes/nope/actions")).status_code == 404


# -- failures ----------------------------------------------------------------------------------


async def test_jvm_killed_mid_episode_fails_every_episode_on_it_and_only_those(client: httpx.AsyncClient) -> None:
    created = [
        (await client.post("/v1/episodes", json={"task_id": task})).json()
        for task in ("boil/v21", "melt/v25", "freeze/v25")
    ]
    by_pid: dict[int, list[str]] = {}
    for episode in created:
        by_pid.setdefault(episode["info"]["jvm_pid"], []).append(episode["episode_id"])
    assert sorted(len(ids) for ids in by_pid.values()) == [1, 2]  # 3 slots, 2 per JVM
    pid = next(pid for pid, ids in by_pid.items() if len(ids) == 2)
    victims, (bystander,) = by_pid[pid], next(ids for p, ids in by_pid.items() if p != pid)
    os.kill(pid, signal.SIGKILL)

    for victim in victims:  # every episode on the dead JVM ends as failed, with the reason
        step = await client.post(f"/v1/episodes/{victim}/step", json={"action": "open door to kitchen"})
        assert step.status_code == 200
        ended = step.json()
        assert ended["done"] is True and ended["info"]["failed"] is True
        assert "killed by SIGKILL" in ended["info"]["error"]
        state = (await client.get(f"/v1/episodes/{victim}")).json()
        assert state["status"] == "failed" and "killed by SIGKILL" in state["failure"]
    health = (await client.get("/healthz")).json()
    assert health["status"] == "ok"
    metrics = (await client.get("/metrics")).text
    assert 'agentgym_env_episodes_failed_total{environment="sciworld",reason="SlotDiedError"} 2.0' in metrics

    # the episode on the other JVM carries on; the failed ones can be reset onto new slots; new episodes work
    other = await client.post(f"/v1/episodes/{bystander}/step", json={"action": "look around"})
    assert other.json()["done"] is False and "failed" not in other.json()["info"]
    await _eventually(lambda: _slot_gone(pid))
    for victim in victims:
        again = await client.post(f"/v1/episodes/{victim}/reset", json={"task_id": "boil/v21"})
        assert again.status_code == 200 and again.json()["info"]["jvm_pid"] != pid
        moved = await client.post(f"/v1/episodes/{victim}/step", json={"action": "open door to kitchen"})
        assert moved.json()["observation"] == "The door is now open."


async def test_hung_jvm_times_out_and_its_slot_is_replaced() -> None:
    manager, http = await _service(step_timeout_s=2.0)
    pool = shared_pool(pool_settings(**SETTINGS))
    pid = -1
    try:
        async with http:
            created = (await http.post("/v1/episodes", json={"task_id": "boil/v21"})).json()
            assert "info" in created, f"{created} (pool: {pool.stats()})"
            pid = created["info"]["jvm_pid"]
            os.kill(pid, signal.SIGSTOP)  # the JVM stops answering mid-episode
            step = (await http.post(f"/v1/episodes/{created['episode_id']}/step", json={"action": "wait1"})).json()
            assert step["done"] is True and step["info"]["failed"] is True, step
            assert "timed out" in step["info"]["error"], step
            # the episode's close found the call still running in the JVM: it is killed, never reused
            await _eventually(lambda: _slot_gone(pid))
            assert (await http.get("/healthz")).json()["status"] == "ok"
            fresh = (await http.post("/v1/episodes", json={"task_id": "boil/v21"})).json()
            assert "info" in fresh, f"{fresh} (pool: {pool.stats()})"
            assert fresh["info"]["jvm_pid"] != pid and fresh["observation"].startswith("Your task"), fresh
    finally:
        await manager.stop()
        if pool.stats()["pids"].count(pid):  # never leave a stopped JVM behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- the expert through the public API (slow) --------------------------------------------------


def _test_sample(count: int, seed: int = 2025) -> list[str]:
    """`count` distinct test variations spread over all 23 tasks (round robin, random variations)."""
    rng = random.Random(seed)
    kinds = [kind for kind in catalog.kinds if not kind.excluded]
    per_kind = [count // len(kinds) + (i < count % len(kinds)) for i in range(len(kinds))]
    picks = [rng.sample(kind.ranges["test"], n) for kind, n in zip(kinds, per_kind, strict=True)]
    return [f"{kinds[i % len(kinds)].name}/v{picks[i % len(kinds)][i // len(kinds)]}" for i in range(count)]


@pytest.mark.slow
async def test_gold_paths_replayed_over_http_score_100() -> None:
    manager, http = await _service(step_timeout_s=60.0)
    expert = make_expert("sciworld", **SETTINGS)
    sample = _test_sample(50)
    assert len(set(sample)) == 50
    scores: dict[str, float] = {}
    queue: asyncio.Queue[str] = asyncio.Queue()
    for task_id in sample:
        queue.put_nowait(task_id)

    async def worker() -> None:
        while not queue.empty():
            task_id = queue.get_nowait()
            actions = await asyncio.to_thread(expert.demonstrate, task_id)
            created = (await http.post("/v1/episodes", json={"task_id": task_id})).json()
            eid = created["episode_id"]
            score = 0.0
            for action in actions:
                result = (await http.post(f"/v1/episodes/{eid}/step", json={"action": action})).json()
                score = result["score"]
                if result["done"]:
                    break
            scores[task_id] = score
            await http.delete(f"/v1/episodes/{eid}")

    try:
        async with http:
            await asyncio.gather(worker(), worker())
    finally:
        await manager.stop()
    perfect = [task_id for task_id, score in scores.items() if score == 100.0]
    missed = {task_id: score for task_id, score in scores.items() if score != 100.0}
    print(f"gold replay: {len(perfect)}/{len(scores)} test variations score 100; others: {missed}")
    assert len(scores) == 50
    assert len(perfect) >= 48, missed  # >= 95 %
