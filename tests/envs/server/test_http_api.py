"""HTTP contract of the environment-service framework, including every bad-input case."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from countdown_env import CountdownCatalog, CountdownEnv, make_manager

from agentgym.envs.server.http_api import create_app
from agentgym.envs.server.manager import EpisodeManager, ManagerConfig


@pytest.fixture
async def client(manager: EpisodeManager) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(manager, compat=False, manage_lifecycle=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://env") as c:
        yield c


async def test_episode_lifecycle(client: httpx.AsyncClient) -> None:
    created = await client.post("/v1/episodes", json={"task_id": "count/2"})
    assert created.status_code == 201
    body = created.json()
    assert body["observation"] == "Say tick 2 times."
    assert body["available_actions"] == ["tick"]
    eid = body["episode_id"]

    first = (await client.post(f"/v1/episodes/{eid}/step", json={"action": "tick"})).json()
    assert first == {
        "observation": "1 to go.",
        "reward": 0.0,
        "score": 0.0,
        "done": False,
        "truncated": False,
        "available_actions": ["tick"],
        "info": {"invalid_action": False, "success": False},
    }
    second = (await client.post(f"/v1/episodes/{eid}/step", json={"action": "tick"})).json()
    assert second["done"] is True and second["reward"] == 1.0 and second["info"]["success"] is True

    observed = (await client.get(f"/v1/episodes/{eid}")).json()
    assert observed["status"] == "done" and observed["steps"] == 2 and observed["observation"] == "Done!"

    after = await client.post(f"/v1/episodes/{eid}/step", json={"action": "tick"})
    assert after.status_code == 409 and "over" in after.json()["detail"]

    assert (await client.delete(f"/v1/episodes/{eid}")).status_code == 204
    gone = await client.get(f"/v1/episodes/{eid}")
    assert gone.status_code == 404


async def test_create_by_split_and_index_then_reset(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/episodes", json={"split": "test", "index": 2})).json()
    assert body["task_id"] == "count/103" and body["observation"] == "Say tick 3 times."
    again = await client.post(f"/v1/episodes/{body['episode_id']}/reset", json={"task_id": "count/1"})
    assert again.status_code == 200 and again.json()["observation"] == "Say tick 1 times."


async def test_open_without_task_then_reset(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/episodes")).json()
    assert body["task_id"] is None
    eid = body["episode_id"]
    early = await client.post(f"/v1/episodes/{eid}/step", json={"action": "tick"})
    assert early.status_code == 409 and "no task yet" in early.json()["detail"]
    reset = await client.post(f"/v1/episodes/{eid}/reset", json={"split": "train", "index": 0})
    assert reset.json()["task_id"] == "count/1"


@pytest.mark.parametrize(
    ("path_kind", "expected"),
    [("step", "no live episode"), ("observe", "no live episode"), ("close", "no live episode")],
)
async def test_unknown_episode_is_404_with_message(client: httpx.AsyncClient, path_kind: str, expected: str) -> None:
    if path_kind == "step":
        response = await client.post("/v1/episodes/nope/step", json={"action": "tick"})
    elif path_kind == "observe":
        response = await client.get("/v1/episodes/nope")
    else:
        response = await client.delete("/v1/episodes/nope")
    assert response.status_code == 404
    assert expected in response.json()["detail"] and "'nope'" in response.json()["detail"]


async def test_unknown_task_and_bad_selection(client: httpx.AsyncClient) -> None:
    unknown = await client.post("/v1/episodes", json={"task_id": "count/999"})
    assert unknown.status_code == 404 and "unknown task id" in unknown.json()["detail"]
    out_of_range = await client.post("/v1/episodes", json={"split": "test", "index": 5})
    assert out_of_range.status_code == 404 and "out of range" in out_of_range.json()["detail"]
    bad_split = await client.post("/v1/episodes", json={"split": "nosuch", "index": 0})
    assert bad_split.status_code == 404 and "unknown split" in bad_split.json()["detail"]
    both = await client.post("/v1/episodes", json={"task_id": "count/1", "split": "train", "index": 0})
    assert both.status_code == 422
    half = await client.post("/v1/episodes", json={"split": "train"})
    assert half.status_code == 422
    negative = await client.post("/v1/episodes", json={"split": "train", "index": -1})
    assert negative.status_code == 422
    extra = await client.post("/v1/episodes", json={"task": "count/1"})
    assert extra.status_code == 422


async def test_malformed_json_is_422(client: httpx.AsyncClient) -> None:
    eid = (await client.post("/v1/episodes", json={"task_id": "count/2"})).json()["episode_id"]
    broken = await client.post(
        f"/v1/episodes/{eid}/step", content=b'{"action": ', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 422
    missing = await client.post(f"/v1/episodes/{eid}/step", json={})
    assert missing.status_code == 422
    wrong_type = await client.post(f"/v1/episodes/{eid}/step", json={"action": 3})
    assert wrong_type.status_code == 422
    # Nothing was lost: the episode still steps normally.
    ok = await client.post(f"/v1/episodes/{eid}/step", json={"action": "tick"})
    assert ok.status_code == 200 and ok.json()["observation"] == "1 to go."


async def test_unparsable_action_is_an_observation(client: httpx.AsyncClient) -> None:
    eid = (await client.post("/v1/episodes", json={"task_id": "count/2"})).json()["episode_id"]
    response = await client.post(f"/v1/episodes/{eid}/step", json={"action": "dance"})
    assert response.status_code == 200
    body = response.json()
    assert body["info"]["invalid_action"] is True and "Valid actions: tick" in body["observation"]
    assert body["done"] is False


async def test_crash_ends_only_that_episode(client: httpx.AsyncClient) -> None:
    healthy = (await client.post("/v1/episodes", json={"task_id": "count/2"})).json()["episode_id"]
    doomed = (await client.post("/v1/episodes", json={"task_id": "count/2"})).json()["episode_id"]
    crashed = await client.post(f"/v1/episodes/{doomed}/step", json={"action": "crash"})
    assert crashed.status_code == 200
    body = crashed.json()
    assert body["done"] is True and body["info"]["failed"] is True
    assert "simulated engine crash" in body["info"]["error"]
    state = (await client.get(f"/v1/episodes/{doomed}")).json()
    assert state["status"] == "failed" and "simulated engine crash" in state["failure"]
    again = await client.post(f"/v1/episodes/{doomed}/step", json={"action": "tick"})
    assert again.status_code == 409 and "failed" in again.json()["detail"]
    # The service and the other episode are fine.
    assert (await client.get("/healthz")).json()["status"] == "ok"
    other = await client.post(f"/v1/episodes/{healthy}/step", json={"action": "tick"})
    assert other.status_code == 200 and other.json()["observation"] == "1 to go."
    # A failed episode can be reset onto a fresh instance.
    reset = await client.post(f"/v1/episodes/{doomed}/reset", json={"task_id": "count/1"})
    assert reset.status_code == 200
    assert (await client.post(f"/v1/episodes/{doomed}/step", json={"action": "tick"})).json()["done"] is True


async def test_step_timeout_fails_the_episode(client: httpx.AsyncClient) -> None:
    eid = (await client.post("/v1/episodes", json={"task_id": "count/2"})).json()["episode_id"]
    body = (await client.post(f"/v1/episodes/{eid}/step", json={"action": "hang 2"})).json()
    assert body["done"] is True and body["info"]["failed"] is True and "timed out" in body["info"]["error"]
    assert (await client.get("/healthz")).status_code == 200


async def test_step_timeout_counts_from_when_a_worker_starts_the_step() -> None:
    # 12 steps of 0.4 s on 4 workers: the last ones wait 0.8 s for a worker and run 0.4 s, inside the
    # 1 s step timeout only because the wait is not counted.
    manager = make_manager(max_episodes=12, step_timeout_s=1.0, worker_threads=4)
    await manager.start()
    episodes = [(await manager.open("count/1"))[0].episode_id for _ in range(12)]
    results = await asyncio.gather(*(manager.step(eid, "hang 0.4") for eid in episodes))
    assert [result.info.get("failed", False) for result in results] == [False] * 12
    waits = manager.metrics.worker_wait_seconds.collect()[0].samples
    assert next(s.value for s in waits if s.name.endswith("_count")) >= 12
    assert next(s.value for s in waits if s.name.endswith("_sum")) > 0.8  # some of them did wait
    await manager.stop()


async def test_a_call_waiting_too_long_for_a_worker_fails_its_episode_unstarted() -> None:
    manager = make_manager(step_timeout_s=5.0, worker_threads=1, worker_wait_timeout_s=0.2)
    await manager.start()
    busy = (await manager.open("count/2"))[0].episode_id
    waiting = (await manager.open("count/2"))[0].episode_id
    hanging = asyncio.create_task(manager.step(busy, "hang 0.6"))
    await asyncio.sleep(0.05)  # the only worker is in the hanging step
    result = await manager.step(waiting, "tick")
    assert result.done and result.info["failed"] is True
    assert result.info["error"] == "waited 0.2s for a free worker thread (all 1 busy)"
    assert (await hanging).info.get("failed", False) is False  # the busy one finished in its own time
    await asyncio.sleep(0.1)
    assert manager.get(waiting).steps == 0  # the dropped call never ran
    failed = manager.metrics.failed.labels("countdown", "worker_wait")._value.get()
    assert failed == 1
    await manager.stop()


async def test_capacity_is_429() -> None:
    manager = make_manager(max_episodes=2)
    await manager.start()
    app = create_app(manager, compat=False, manage_lifecycle=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env") as client:
        ids = [(await client.post("/v1/episodes", json={"task_id": "count/1"})).json()["episode_id"] for _ in range(2)]
        refused = await client.post("/v1/episodes", json={"task_id": "count/1"})
        assert refused.status_code == 429 and "cap reached (2)" in refused.json()["detail"]
        assert refused.headers["retry-after"] == "1"
        await client.delete(f"/v1/episodes/{ids[0]}")
        assert (await client.post("/v1/episodes", json={"task_id": "count/1"})).status_code == 201
    await manager.stop()


async def test_idle_episodes_are_reaped() -> None:
    manager = make_manager(idle_timeout_s=0.2, reap_interval_s=0.05)
    await manager.start()
    closed_before = CountdownEnv.closed
    episode, _ = await manager.open("count/3")
    await asyncio.sleep(0.6)
    assert manager.live_episodes == 0
    await asyncio.sleep(0.1)  # closing happens on a worker thread
    assert CountdownEnv.closed > closed_before
    with pytest.raises(LookupError):
        manager.get(episode.episode_id)
    await manager.stop()


async def test_tasks_listing_and_metrics(client: httpx.AsyncClient) -> None:
    splits = (await client.get("/v1/tasks")).json()
    assert splits["splits"] == {"train": 20, "test": 5}
    page = (await client.get("/v1/tasks", params={"split": "train", "offset": 18, "limit": 5})).json()
    assert page["task_ids"] == ["count/19", "count/20"]
    assert (await client.get("/v1/tasks", params={"split": "zzz"})).status_code == 404
    described = (await client.get("/v1/tasks/count/103")).json()
    assert described == {"task_id": "count/103", "split": "test", "ticks": 3}
    eid = (await client.post("/v1/episodes", json={"task_id": "count/1"})).json()["episode_id"]
    await client.post(f"/v1/episodes/{eid}/step", json={"action": "tick"})
    text = (await client.get("/metrics")).text
    assert 'agentgym_env_steps_total{environment="countdown"} 1.0' in text
    assert 'agentgym_env_episodes_live{environment="countdown"} 1.0' in text


async def test_openapi_docs_are_served(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    assert "/v1/episodes/{episode_id}/step" in spec["paths"]
    assert (await client.get("/docs")).status_code == 200


async def test_environment_out_of_capacity_is_429_and_the_episode_survives() -> None:
    from agentgym.envs.base import EnvironmentBusyError

    class BusyOnce(CountdownEnv):
        busy = True

        def reset(self, task_id: str) -> Any:
            if BusyOnce.busy:
                BusyOnce.busy = False
                raise EnvironmentBusyError("every slot is leased")
            return super().reset(task_id)

    manager = EpisodeManager("countdown", BusyOnce, CountdownCatalog(), ManagerConfig(max_episodes=4))
    await manager.start()
    app = create_app(manager, compat=False, manage_lifecycle=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env") as client:
        refused = await client.post("/v1/episodes", json={"task_id": "count/1"})
        assert refused.status_code == 429 and "busy: every slot is leased" in refused.json()["detail"]
        assert manager.live_episodes == 0  # nothing half-created is left behind
        assert (await client.post("/v1/episodes", json={"task_id": "count/1"})).status_code == 201
    await manager.stop()


async def test_stop_closes_every_episode() -> None:
    manager = make_manager()
    await manager.start()
    closed_before = CountdownEnv.closed
    for _ in range(3):
        await manager.open("count/2")
    await manager.stop()
    assert CountdownEnv.closed - closed_before == 3


@pytest.mark.parametrize("option", ["--step-timeout", "--worker-wait-timeout"])
def test_env_serve_refuses_a_timeout_below_its_bound_before_starting(option: str) -> None:
    from typer.testing import CliRunner

    from agentgym.cli.main import app

    refused = CliRunner().invoke(app, ["env", "serve", "countdown-not-needed", option, "0"])
    assert refused.exit_code == 2 and option in refused.output
