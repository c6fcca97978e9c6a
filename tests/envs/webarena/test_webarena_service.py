"""The browser environment behind the service: solvers through the public APIs, AgentGym's
routes, bad inputs, and a browser killed mid-episode."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from google.protobuf import json_format
from service_helpers import running_service

from agentgym.envs.webarena.browser import shared_host
from agentgym.envs.webarena.miniwob import SOLVERS
from agentgym.proto import env_pb2

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="needs Debian's chromium")


async def test_solvers_over_http() -> None:
    async with running_service("webarena") as (client, _, _):
        for name, solver in sorted(SOLVERS.items()):
            opened = await client.post("/v1/episodes", json={"task_id": f"miniwob/{name}/1000002"})
            assert opened.status_code == 201, opened.text
            body = opened.json()
            episode, observation, objective = body["episode_id"], body["observation"], body["info"]["objective"]
            history: list[str] = []
            for _ in range(10):
                action = solver(objective, observation, history)
                history.append(action)
                reply = (await client.post(f"/v1/episodes/{episode}/step", json={"action": action})).json()
                observation = reply["observation"]
                if reply["done"]:
                    break
            assert reply["done"] and reply["reward"] == 1.0 and reply["info"]["success"] is True, (name, history)
            assert (await client.delete(f"/v1/episodes/{episode}")).status_code == 204


async def test_solver_over_grpc() -> None:
    solver = SOLVERS["click-checkboxes"]
    async with running_service("webarena") as (_, stub, _):
        task = env_pb2.TaskSelector(task_id="miniwob/click-checkboxes/1000004")
        opened = await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=task))
        objective = json_format.MessageToDict(opened.info)["objective"]
        observation, history = opened.observation, list[str]()
        for _ in range(10):
            history.append(solver(objective, observation, history))
            reply = await stub.Step(env_pb2.StepRequest(episode_id=opened.episode_id, action=history[-1]))
            observation = reply.observation
            if reply.done:
                break
        assert reply.done and reply.reward == 1.0


async def test_agentgym_compat_routes() -> None:
    async with running_service("webarena") as (client, _, manager):
        assert (await client.get("/")).text == "This is environment WebArena."
        assert (await client.post("/create")).json() == {"env_idx": 0}
        reset = (await client.post("/reset", json={"env_idx": 0, "seed": 0, "idx": 0})).json()
        assert set(reset) == {"observation", "sites", "object"}
        task_id = manager.catalog.task_id("test", 0)
        assert task_id.startswith("miniwob/click-button/") and reset["sites"] == ["miniwob"]
        assert reset["object"].startswith("Click on the") and "OBJECTIVE:" in reset["observation"]
        history: list[str] = []
        stepped: dict = {}
        observation = reset["observation"]
        for _ in range(5):
            history.append(SOLVERS["click-button"](reset["object"], observation, history))
            stepped = (await client.post("/step", json={"env_idx": 0, "action": history[-1]})).json()
            observation = stepped["observation"]
            if stepped["terminated"]:
                break
        assert set(stepped) == {"observation", "reward", "terminated", "truncated", "info"}
        assert stepped["terminated"] is True and stepped["reward"] == 1.0 and stepped["truncated"] is False
        assert (await client.get("/observation", params={"env_idx": 0})).json() == stepped["observation"]
        assert (await client.post("/close", json={"env_idx": 0})).json() == {"closed": True}


async def test_agentgym_compat_step_reads_the_action_from_the_whole_reply() -> None:
    """AgentGym's WebArena client sends the model's whole reply; its server extracts the fenced action."""
    async with running_service("webarena") as (client, _, _):
        env_idx = (await client.post("/create")).json()["env_idx"]
        reset = (await client.post("/reset", json={"env_idx": env_idx, "seed": 0, "idx": 0})).json()
        history: list[str] = []
        stepped: dict = {}
        observation = reset["observation"]
        for _ in range(5):
            history.append(SOLVERS["click-button"](reset["object"], observation, history))
            reply = (
                "Let's think step-by-step. The objective names a button; the page lists it with its id. "
                f"In summary, the next action I will perform is ```{history[-1]}```"
            )
            stepped = (await client.post("/step", json={"env_idx": env_idx, "action": reply})).json()
            observation = stepped["observation"]
            assert "Unknown action" not in observation
            if stepped["terminated"]:
                break
        assert stepped["terminated"] is True and stepped["reward"] == 1.0


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/step", {"env_idx": 3, "action": "click [1]"}, 404, "no live episode"),
        ("/reset", {"env_idx": 3, "idx": 0}, 404, "no live episode"),
        ("/close", {"env_idx": 3}, 404, "no live episode"),
        ("/reset", {"env_idx": 0, "idx": 10_000_000}, 404, "out of range"),
        ("/step", {"env_idx": 0, "action": "click [1]"}, 409, "no task yet"),
    ],
)
async def test_agentgym_compat_errors(path: str, body: dict, status: int, fragment: str) -> None:
    async with running_service("webarena") as (client, _, _):
        await client.post("/create")
        response = await client.post(path, json=body)
        assert response.status_code == status and fragment in response.json()["error"]


async def test_unknown_tasks_and_episodes_over_http() -> None:
    async with running_service("webarena") as (client, _, _):
        for task_id in ("miniwob/drag-box/1", "miniwob/click-button/x", "webarena/12", "nope"):
            response = await client.post("/v1/episodes", json={"task_id": task_id})
            assert response.status_code == 404 and "unknown" in response.text.lower(), task_id
        assert (await client.post("/v1/episodes/nope/step", json={"action": "click [1]"})).status_code == 404


async def test_browser_killed_mid_episode_fails_that_episode_only() -> None:
    host = shared_host()
    async with running_service("webarena") as (client, _, _):
        victim = (await client.post("/v1/episodes", json={"task_id": "miniwob/click-button/1000010"})).json()
        pid = await asyncio.to_thread(host.call, host.browser_pid, 30)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        ended = (
            await client.post(f"/v1/episodes/{victim['episode_id']}/step", json={"action": "scroll [down]"})
        ).json()
        assert ended["done"] is True and ended["info"]["failed"] is True
        assert "browser" in ended["info"]["error"].lower() or "closed" in ended["info"]["error"].lower()
        assert (await client.get("/healthz")).json()["status"] == "ok"
        # the failed episode resets onto the relaunched browser; new episodes work
        again = await client.post(
            f"/v1/episodes/{victim['episode_id']}/reset", json={"task_id": "miniwob/focus-text/1000010"}
        )
        assert again.status_code == 200, again.text
        field = next(line for line in again.json()["observation"].splitlines() if "] textbox " in line)
        node = field.split("]")[0].strip("\t [")
        moved = (
            await client.post(f"/v1/episodes/{victim['episode_id']}/step", json={"action": f"click [{node}]"})
        ).json()
        assert moved["done"] and moved["reward"] == 1.0
