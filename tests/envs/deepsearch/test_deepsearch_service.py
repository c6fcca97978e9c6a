"""Deep Search behind the environment service: native /v1 episodes, AgentGym SearchQA routes, bad
inputs, and a whole deployment over real HTTP (env service -> external retrieval service)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from deepsearch_helpers import TINY_CORPUS, closed_port_url, serve_app, write_jsonl

from agentgym.envs.deepsearch.index import BM25Index
from agentgym.envs.deepsearch.retriever import create_retrieval_app
from agentgym.envs.server.http_api import create_app
from agentgym.envs.server.limits import MAX_ACTION_CHARS
from agentgym.envs.server.manager import EpisodeManager, ManagerConfig
from agentgym.envs.server.runner import build_manager

BEATLES = "fanoutqa-sub/60388a3ad855c948"


async def _client(manager: EpisodeManager) -> httpx.AsyncClient:
    app = create_app(manager, manage_lifecycle=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env", timeout=30)


@pytest.fixture
async def service(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[httpx.AsyncClient, EpisodeManager]]:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    manager = build_manager("deepsearch", ManagerConfig(max_episodes=4, worker_threads=2))
    await manager.start()
    async with await _client(manager) as client:
        yield client, manager
    await manager.stop()


async def test_search_then_answer_episode(service: tuple[httpx.AsyncClient, EpisodeManager]) -> None:
    client, _ = service
    created = await client.post("/v1/episodes", json={"task_id": BEATLES})
    assert created.status_code == 201
    body = created.json()
    assert body["observation"].endswith("Question: What is the origin city of The Beatles?")
    episode = body["episode_id"]

    searched = (
        await client.post(f"/v1/episodes/{episode}/step", json={"action": "<search>The Beatles</search>"})
    ).json()
    assert searched["observation"].startswith('<information>Doc 1(Title: "The Beatles")')
    assert "formed in Liverpool" in searched["observation"] and not searched["done"]

    wrong = (await client.post(f"/v1/episodes/{episode}/step", json={"action": "<answer>London</answer>"})).json()
    assert not wrong["done"] and wrong["reward"] == 0.0 and wrong["info"]["em"] == 0.0

    right = (await client.post(f"/v1/episodes/{episode}/step", json={"action": "<answer>Liverpool</answer>"})).json()
    assert right["done"] and right["reward"] == 1.0 and right["score"] == 1.0
    assert right["info"]["em"] == 1.0 and right["info"]["f1"] == 1.0 and right["info"]["success"]

    observed = (await client.get(f"/v1/episodes/{episode}")).json()
    assert observed["status"] == "done" and observed["steps"] == 3 and observed["score"] == 1.0
    after = await client.post(f"/v1/episodes/{episode}/step", json={"action": "<answer>Liverpool</answer>"})
    assert after.status_code == 409
    assert (await client.delete(f"/v1/episodes/{episode}")).status_code == 204


async def test_tasks_listing_and_bad_native_inputs(service: tuple[httpx.AsyncClient, EpisodeManager]) -> None:
    client, _ = service
    listing = (await client.get("/v1/tasks", params={"split": "test", "limit": 2})).json()
    assert listing["splits"]["test"] == 28 and listing["task_ids"][0] == BEATLES
    described = (await client.get(f"/v1/tasks/{BEATLES}")).json()
    assert described["question"] == "What is the origin city of The Beatles?"
    unknown = await client.post("/v1/episodes", json={"task_id": "fanoutqa-sub/nope"})
    assert unknown.status_code == 404 and "unknown Deep Search task" in unknown.json()["detail"]
    assert (await client.post("/v1/episodes", json={"split": "test", "index": 28})).status_code == 404
    assert (await client.post("/v1/episodes/nope/step", json={"action": "<search>x</search>"})).status_code == 404
    episode = (await client.post("/v1/episodes", json={"split": "test", "index": 0})).json()["episode_id"]
    too_long = await client.post(f"/v1/episodes/{episode}/step", json={"action": "x" * (MAX_ACTION_CHARS + 1)})
    assert too_long.status_code == 422 and "action" in too_long.json()["error"]
    invalid = (await client.post(f"/v1/episodes/{episode}/step", json={"action": "just text"})).json()
    assert invalid["info"]["invalid_action"] and "<search> and </search>" in invalid["observation"]


async def test_agentgym_searchqa_routes(service: tuple[httpx.AsyncClient, EpisodeManager]) -> None:
    client, manager = service
    assert (await client.get("/")).json() == "ok"
    env_idx = (await client.post("/create", json={"id": 0})).json()
    assert isinstance(env_idx, int)
    question = (await client.get("/observation", params={"env_idx": env_idx})).json()
    assert question.endswith("Question: What is the origin city of The Beatles?")

    response = "<think>Let me search.</think>\n<search>The Beatles</search>"
    step = (await client.post("/step", json={"env_idx": env_idx, "action": response})).json()
    assert set(step) == {"observation", "reward", "done", "info"}
    assert step["observation"].startswith("<information>") and step["reward"] == 0 and step["done"] is False
    # AgentGym's /observation keeps showing the question
    assert (await client.get("/observation", params={"env_idx": env_idx})).json() == question

    done = (await client.post("/step", json={"env_idx": env_idx, "action": "<answer> Liverpool </answer>"})).json()
    assert done["reward"] == 1.0 and done["done"] is True
    over = await client.post("/step", json={"env_idx": env_idx, "action": "<answer>x</answer>"})
    assert over.status_code == 409 and "error" in over.json()

    catalog: Any = manager.catalog
    again = (await client.post("/reset", json={"env_idx": env_idx, "id": 28})).json()
    assert again.endswith(f"Question: {catalog.task(catalog.task_id('train', 0)).question}")
    same = (await client.post("/reset", json={"env_idx": env_idx})).json()
    assert same == again
    assert (await client.post("/step", json={"env_idx": env_idx, "action": "<search>x y</search>"})).status_code == 200

    assert (await client.post("/close", json={"env_idx": env_idx})).json() is True
    closed = await client.post("/close", json={"env_idx": env_idx})
    assert closed.status_code == 404 and "no live episode" in closed.json()["error"]
    assert manager.live_episodes == 0


@pytest.mark.parametrize(
    ("method", "path", "payload", "status"),
    [
        ("post", "/create", {"id": 10_000}, 404),
        ("post", "/create", {"id": -1}, 404),
        ("post", "/create", {"id": "zero"}, 422),
        # booleans (and numbers as text, and fractions) are not data indices
        ("post", "/create", {"id": False}, 422),
        ("post", "/create", {"id": "1"}, 422),
        ("post", "/create", {"id": 1.5}, 422),
        ("post", "/step", {"env_idx": True, "action": "<search>x</search>"}, 422),
        ("post", "/reset", {"env_idx": 0, "id": True}, 422),
        ("post", "/close", {"env_idx": False}, 422),
        ("post", "/step", {"env_idx": 0, "action": "x" * (MAX_ACTION_CHARS + 1)}, 422),
        ("post", "/step", {"env_idx": 99, "action": "<search>x</search>"}, 404),
        ("post", "/step", {"env_idx": 0}, 422),
        ("post", "/reset", {"env_idx": 99, "id": 0}, 404),
        ("post", "/close", {"env_idx": 99}, 404),
        ("get", "/observation", {"env_idx": 99}, 404),
        ("get", "/observation", {}, 422),
    ],
)
async def test_bad_agentgym_requests(
    service: tuple[httpx.AsyncClient, EpisodeManager], method: str, path: str, payload: dict[str, Any], status: int
) -> None:
    client, _ = service
    if method == "get":
        response = await client.get(path, params=payload)
    else:
        response = await client.post(path, json=payload)
    assert response.status_code == status
    if status == 404:
        assert response.json()["error"]


async def test_reset_to_an_out_of_range_index_keeps_the_episode(
    service: tuple[httpx.AsyncClient, EpisodeManager],
) -> None:
    client, _ = service
    env_idx = (await client.post("/create", json={"id": 1})).json()
    assert (await client.post("/reset", json={"env_idx": env_idx, "id": 5_000})).status_code == 404
    step = await client.post("/step", json={"env_idx": env_idx, "action": "<search>Beatles</search>"})
    assert step.status_code == 200


async def test_search_outage_fails_the_episode_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    manager = build_manager("deepsearch", ManagerConfig(worker_threads=2), {"search_url": closed_port_url()})
    await manager.start()
    try:
        async with await _client(manager) as client:
            episode = (await client.post("/v1/episodes", json={"task_id": BEATLES})).json()["episode_id"]
            step = (await client.post(f"/v1/episodes/{episode}/step", json={"action": "<search>x</search>"})).json()
            assert step["done"] and step["info"]["failed"]
            assert "RetrievalError" in step["info"]["error"] and "unreachable" in step["info"]["error"]
            assert (await client.get(f"/v1/episodes/{episode}")).json()["status"] == "failed"
            # observe mode: the agent is told and the episode goes on
            manager_observe = build_manager(
                "deepsearch",
                ManagerConfig(worker_threads=2),
                {"search_url": closed_port_url(), "on_search_error": "observe"},
            )
            await manager_observe.start()
            try:
                async with await _client(manager_observe) as observing:
                    opened = (await observing.post("/v1/episodes", json={"task_id": BEATLES})).json()
                    path = f"/v1/episodes/{opened['episode_id']}/step"
                    told = (await observing.post(path, json={"action": "<search>x</search>"})).json()
                    assert told["observation"].startswith("The search failed") and not told["done"]
            finally:
                await manager_observe.stop()
    finally:
        await manager.stop()


def test_whole_deployment_over_http_with_an_external_retriever(tmp_path: Path) -> None:
    """Env service and retrieval service as two real HTTP servers; env_config names the retriever."""
    index = BM25Index.load_or_build(write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS), tmp_path / "cache")
    dataset = write_jsonl(
        tmp_path / "veloria.jsonl",
        [{"question": "What is the highest peak of Veloria?", "golden_answers": ["Mount Kest", "Kest"]}],
    )
    with serve_app(create_retrieval_app(index)) as search_url:
        env_config = {"search_url": search_url, "topk": 2, "datasets": {"svc-veloria": str(dataset)}}
        manager = build_manager("deepsearch", ManagerConfig(worker_threads=2), env_config)
        with serve_app(create_app(manager)) as env_url, httpx.Client(base_url=env_url, timeout=30) as client:
            # env_config datasets register when the first instance is made: open, then reset to the task
            created = client.post("/v1/episodes")
            assert created.status_code == 201, created.text
            episode = created.json()["episode_id"]
            reset = client.post(f"/v1/episodes/{episode}/reset", json={"task_id": "svc-veloria/0"})
            assert reset.json()["observation"].endswith("Question: What is the highest peak of Veloria?")
            step = client.post(f"/v1/episodes/{episode}/step", json={"action": "<search>highest peak Veloria</search>"})
            observation = step.json()["observation"]
            assert observation.startswith('<information>Doc 1(Title: "Mount Kest") Mount Kest is the highest peak')
            assert observation.count("Doc ") == 2
            answer = client.post(f"/v1/episodes/{episode}/step", json={"action": "<answer>Kest</answer>"}).json()
            assert answer["done"] and answer["reward"] == 1.0
            # AgentGym clients reach the same episode kinds
            env_idx = client.post("/create", json={"id": 0}).json()
            assert client.post("/close", json={"env_idx": env_idx}).json() is True
