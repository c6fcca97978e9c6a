"""BabyAI behind the service: the expert solves through HTTP and gRPC; AgentGym's routes work."""

from __future__ import annotations

import pytest
from google.protobuf import json_format
from service_helpers import play_http, running_service

from agentgym.envs import make_expert
from agentgym.envs.babyai.env import BabyAIEnv
from agentgym.proto import env_pb2


async def test_expert_solves_test_tasks_over_http() -> None:
    expert = make_expert("babyai")
    task_ids = list(BabyAIEnv.catalog().task_ids("test", limit=80))  # two seeds of every level
    async with running_service("babyai") as (client, _, _):
        results = [await play_http(client, t, expert.demonstrate(t)) for t in task_ids]
    solved = sum(bool(r["info"]["success"]) and r["reward"] > 0 for r in results)
    assert solved / len(task_ids) >= 0.95, f"{solved}/{len(task_ids)}"


async def test_expert_solves_over_grpc() -> None:
    expert = make_expert("babyai")
    async with running_service("babyai") as (_, stub, _):
        for task_id in BabyAIEnv.catalog().task_ids("test", limit=40)[::8]:
            opened = await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=env_pb2.TaskSelector(task_id=task_id)))
            assert opened.has_available_actions and "turn left" in opened.available_actions
            for action in expert.demonstrate(task_id):
                reply = await stub.Step(env_pb2.StepRequest(episode_id=opened.episode_id, action=action))
                if reply.done:
                    break
            info = json_format.MessageToDict(reply.info)
            assert reply.done and info["success"] is True and 0 < reply.reward <= 1


async def test_agentgym_compat_routes() -> None:
    async with running_service("babyai") as (client, _, manager):
        assert (await client.get("/")).text == "This is environment BabyAI."
        created = (await client.post("/create")).json()
        assert created == {"id": 0}
        reset = (await client.post("/reset", json={"id": 0, "data_idx": 41})).json()
        assert set(reset) == {"observation", "reward", "score", "deleted", "done"}
        assert reset["done"] is False and reset["observation"]
        task_id = manager.catalog.task_id("test", 41)  # AgentGym: level 41 % 40, seed 41 // 40
        assert task_id == f"{BabyAIEnv.catalog().task_id('test', 1).split('/')[0]}/s1"
        for action in make_expert("babyai").demonstrate(task_id):
            stepped = (await client.post("/step", json={"id": 0, "action": action})).json()
            if stepped["done"]:
                break
        assert set(stepped) == {"observation", "reward", "score", "done"}
        assert stepped["done"] is True and stepped["reward"] > 0 and stepped["score"] == stepped["reward"]
        assert (await client.get("/observation", params={"id": 0})).json() == stepped["observation"]
        after = await client.post("/step", json={"id": 0, "action": "turn left"})
        assert after.status_code == 409 and "over" in after.json()["error"]
        assert (await client.post("/close", json={"id": 0})).json() == {"closed": True}


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/step", {"id": 3, "action": "turn left"}, 404, "no live episode"),
        ("/reset", {"id": 3, "data_idx": 0}, 404, "no live episode"),
        ("/close", {"id": 3}, 404, "no live episode"),
        ("/reset", {"id": 0, "data_idx": 10_000_000}, 404, "out of range"),
        ("/step", {"id": 0, "action": "turn left"}, 409, "no task yet"),
    ],
)
async def test_agentgym_compat_errors(path: str, body: dict, status: int, fragment: str) -> None:
    async with running_service("babyai") as (client, _, _):
        await client.post("/create")
        response = await client.post(path, json=body)
        assert response.status_code == status and fragment in response.json()["error"]


async def test_unparsable_action_over_http_is_an_observation() -> None:
    async with running_service("babyai") as (client, _, _):
        opened = (await client.post("/v1/episodes", json={"split": "test", "index": 0})).json()
        reply = (await client.post(f"/v1/episodes/{opened['episode_id']}/step", json={"action": "fly away"})).json()
        assert reply["info"]["invalid_action"] is True and reply["done"] is False
        assert "turn left" in reply["observation"]
