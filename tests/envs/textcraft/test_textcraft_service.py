"""TextCraft behind the service: the expert solves through HTTP and gRPC; AgentGym's routes work."""

from __future__ import annotations

import pytest
from google.protobuf import json_format
from service_helpers import play_http, running_service

from agentgym.envs import make_expert
from agentgym.envs.textcraft.env import TextCraftEnv
from agentgym.proto import env_pb2


async def test_expert_solves_the_test_split_over_http() -> None:
    expert = make_expert("textcraft")
    task_ids = TextCraftEnv.catalog().task_ids("test")
    async with running_service("textcraft") as (client, _, _):
        results = [await play_http(client, t, expert.demonstrate(t)) for t in task_ids]
    solved = sum(r["info"]["success"] and r["reward"] == 1.0 for r in results)
    assert solved == len(task_ids) == 100


async def test_expert_solves_over_grpc() -> None:
    expert = make_expert("textcraft")
    async with running_service("textcraft") as (_, stub, _):
        for task_id in TextCraftEnv.catalog().task_ids("all")[::60]:
            opened = await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=env_pb2.TaskSelector(task_id=task_id)))
            assert "Goal: craft" in opened.observation
            for action in expert.demonstrate(task_id):
                reply = await stub.Step(env_pb2.StepRequest(episode_id=opened.episode_id, action=action))
            assert reply.done and json_format.MessageToDict(reply.info)["success"] is True
            await stub.CloseEpisode(env_pb2.EpisodeRef(episode_id=opened.episode_id))


async def test_agentgym_compat_routes() -> None:
    async with running_service("textcraft") as (client, _, manager):
        assert (await client.get("/")).text == "This is environment TextCraft."
        created = (await client.post("/create", json={"commands": None, "goal": None})).json()
        assert set(created) == {"id", "observation", "done", "reward"} and created["id"] == 0
        assert created["observation"].startswith("Crafting commands:") and created["done"] is False
        reset = (await client.post("/reset", json={"id": 0, "data_idx": 543})).json()
        assert reset["id"] == 0 and "Goal: craft" in reset["observation"]
        goal_task = manager.catalog.task_id("all", 543)
        actions = make_expert("textcraft").demonstrate(goal_task)
        for action in actions:
            stepped = (await client.post("/step", json={"id": 0, "action": action})).json()
        assert set(stepped) == {"observation", "reward", "done"}
        assert stepped == {"observation": stepped["observation"], "reward": 1.0, "done": True}
        observed = (await client.get("/observation", params={"id": 0})).json()
        assert observed == stepped["observation"]
        assert (await client.post("/close", json={"id": 0})).json() == {"closed": True}


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "fragment"),
    [
        ("post", "/step", {"id": 7, "action": "inventory"}, 404, "no live episode"),
        ("post", "/reset", {"id": 7, "data_idx": 0}, 404, "no live episode"),
        ("get", "/observation?id=7", None, 404, "no live episode"),
        ("post", "/close", {"id": 7}, 404, "no live episode"),
        ("post", "/step", {"id": "x"}, 422, ""),
        ("post", "/create", {"goal": "diamond pickaxe"}, 404, "not supported"),
    ],
)
async def test_agentgym_compat_errors(method: str, path: str, body: dict | None, status: int, fragment: str) -> None:
    async with running_service("textcraft") as (client, _, _):
        response = await (client.get(path) if method == "get" else client.post(path, json=body))
        assert response.status_code == status
        if fragment:
            assert fragment in response.json()["error"]


async def test_compat_reset_out_of_range_and_invalid_action() -> None:
    async with running_service("textcraft") as (client, _, _):
        await client.post("/create")
        bad = await client.post("/reset", json={"id": 0, "data_idx": 544})
        assert bad.status_code == 404 and "out of range" in bad.json()["error"]
        reply = (await client.post("/step", json={"id": 0, "action": "fly to the moon"})).json()
        assert reply["reward"] == 0 and reply["done"] is False and "get" in reply["observation"]
