"""Bad input on every front door: invalid Unicode, oversized actions and bodies, booleans for ints,
a close racing a step, episodes never stepped, and an OpenAPI document that says what each route answers."""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from countdown_env import CountdownCatalog, CountdownEnv, make_manager
from service_helpers import running_service

from agentgym.envs.base import StepResult
from agentgym.envs.server.http_api import create_app
from agentgym.envs.server.limits import MAX_ACTION_CHARS, MAX_BODY_BYTES
from agentgym.envs.server.manager import EpisodeClosedError, EpisodeManager, ManagerConfig

JSON = {"content-type": "application/json"}
# The raw JSON text `"\ud800 left"`: a valid JSON string holding a lone surrogate, which no UTF-8 response can carry.
SURROGATE_ACTION = b'"\\ud800 left"'


@pytest.fixture
async def client(manager: EpisodeManager) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(manager, compat=False, manage_lifecycle=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env") as c:
        yield c


def _total(manager: EpisodeManager, name: str) -> float:
    """A counter's value summed over its labels."""
    return sum(
        sample.value
        for metric in manager.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name
    )


async def _episode(client: httpx.AsyncClient, task_id: str = "count/3") -> str:
    created = await client.post("/v1/episodes", json={"task_id": task_id})
    assert created.status_code == 201, created.text
    episode_id: str = created.json()["episode_id"]
    return episode_id


# -- invalid Unicode ---------------------------------------------------------------------------------


async def test_a_lone_surrogate_is_a_422_naming_the_field(client: httpx.AsyncClient) -> None:
    episode = await _episode(client)
    step = await client.post(
        f"/v1/episodes/{episode}/step", content=b'{"action": ' + SURROGATE_ACTION + b"}", headers=JSON
    )
    assert step.status_code == 422 and "action" in step.json()["error"]
    assert step.json()["detail"][0]["loc"] == ["body", "action"]
    task = await client.post("/v1/episodes", content=b'{"task_id": "\\udfff"}', headers=JSON)
    assert task.status_code == 422 and "task_id" in task.json()["error"]
    # An unknown key with a surrogate in it is reported without echoing anything unencodable.
    key = await client.post("/v1/episodes", content=b'{"\\ud800": 1}', headers=JSON)
    assert key.status_code == 422 and key.json()["detail"]
    # Nothing was lost: the episode steps normally.
    assert (await client.post(f"/v1/episodes/{episode}/step", json={"action": "tick"})).json()[
        "observation"
    ] == "2 to go."


@pytest.mark.parametrize("environment", ["babyai", "textcraft"])
async def test_a_lone_surrogate_on_the_agentgym_routes_is_a_422(environment: str) -> None:
    async with running_service(environment) as (client, _, _):
        number = (await client.post("/create")).json()["id"]
        step = await client.post(
            "/step", content=b'{"id": %d, "action": %s}' % (number, SURROGATE_ACTION), headers=JSON
        )
        assert step.status_code == 422
        assert "action" in step.json()["error"] and step.json()["detail"][0]["loc"] == ["body", "action"]


# -- one action limit, one body cap --------------------------------------------------------------------


def _compat_step_models() -> dict[str, type]:
    models = {}
    for kind, module, name in [
        ("babyai", "agentgym.envs.server.compat", "StepBody"),
        ("textcraft", "agentgym.envs.server.compat", "StepBody"),
        ("sciworld", "agentgym.envs.sciworld.compat", "StepBody"),
        ("deepsearch", "agentgym.envs.deepsearch.compat", "StepQuery"),
        ("webarena", "agentgym.envs.webarena.compat", "StepBody"),
    ]:
        models[kind] = getattr(importlib.import_module(module), name)
    return models


def test_every_route_takes_actions_under_the_same_limit() -> None:
    from agentgym.envs.server.http_api import StepIn

    limits = {"native": StepIn.model_json_schema()["properties"]["action"]["maxLength"]}
    for kind, model in _compat_step_models().items():
        limits[kind] = model.model_json_schema()["properties"]["action"]["maxLength"]  # type: ignore[attr-defined]
    assert set(limits.values()) == {MAX_ACTION_CHARS}, limits


@pytest.mark.parametrize("environment", ["babyai", "textcraft"])
async def test_oversized_actions_and_bodies_are_refused_before_any_work(environment: str) -> None:
    async with running_service(environment) as (client, _, manager):
        number = (await client.post("/create")).json()["id"]
        episode = (await client.post("/v1/episodes", json={"split": "test", "index": 0})).json()["episode_id"]
        steps_before = _total(manager, "agentgym_env_steps_total")

        # 10 MB: refused by the body cap, before the JSON is parsed (and never echoed back).
        huge = "x" * 10_000_000
        for path, body in [
            ("/step", {"id": number, "action": huge}),
            (f"/v1/episodes/{episode}/step", {"action": huge}),
        ]:
            started = time.perf_counter()
            refused = await client.post(path, json=body)
            assert refused.status_code == 413, (path, refused.status_code)
            assert "too large" in refused.json()["error"] and len(refused.content) < 1_000
            assert time.perf_counter() - started < 2

        # Under the body cap but over the action limit: 422 naming the field, on both kinds of route.
        long = "x" * (MAX_ACTION_CHARS + 1)
        for path, body in [
            ("/step", {"id": number, "action": long}),
            (f"/v1/episodes/{episode}/step", {"action": long}),
        ]:
            refused = await client.post(path, json=body)
            assert refused.status_code == 422 and "action" in refused.json()["error"], path
            assert len(refused.content) < 1_000  # the input is not echoed

        # A chunked body (no Content-Length) over the cap is refused as soon as it passes it.
        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"action": "'
            for _ in range(MAX_BODY_BYTES // 65_536 + 1):
                yield b"x" * 65_536
            yield b'"}'

        chunked = await client.post(f"/v1/episodes/{episode}/step", content=chunks(), headers=JSON)
        assert chunked.status_code == 413
        assert _total(manager, "agentgym_env_steps_total") == steps_before  # no environment step ran
        # The limit itself is allowed, and the episodes are fine.
        ok = await client.post(f"/v1/episodes/{episode}/step", json={"action": "x" * MAX_ACTION_CHARS})
        assert ok.status_code == 200 and ok.json()["info"]["invalid_action"] is True


async def test_a_small_chunked_body_passes_through(client: httpx.AsyncClient) -> None:
    episode = await _episode(client)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"action": '
        yield b'"tick"}'

    stepped = await client.post(f"/v1/episodes/{episode}/step", content=chunks(), headers=JSON)
    assert stepped.status_code == 200 and stepped.json()["observation"] == "2 to go."


# -- integers are integers -------------------------------------------------------------------------------


async def test_booleans_are_not_integers(client: httpx.AsyncClient) -> None:
    refused = await client.post("/v1/episodes", json={"split": "test", "index": True})
    assert refused.status_code == 422 and "index" in refused.json()["error"]
    async with running_service("babyai") as (compat, _, _):
        await compat.post("/create")
        for body in ({"id": False, "data_idx": 0}, {"id": 0, "data_idx": True}):
            assert (await compat.post("/reset", json=body)).status_code == 422, body
        assert (await compat.post("/close", json={"id": False})).status_code == 422


async def test_null_fields_of_a_task_selection_are_absent(client: httpx.AsyncClient) -> None:
    by_id = await client.post("/v1/episodes", json={"task_id": "count/1", "split": None, "index": None})
    assert by_id.status_code == 201 and by_id.json()["task_id"] == "count/1"
    by_index = await client.post("/v1/episodes", json={"task_id": None, "split": "test", "index": 0})
    assert by_index.status_code == 201 and by_index.json()["task_id"] == "count/101"
    nothing = await client.post("/v1/episodes", json={"task_id": None, "split": None, "index": None})
    assert nothing.status_code == 201 and nothing.json()["task_id"] is None
    # An index alone names no task; the schema says so (a task id, a split with an index, or neither).
    alone = await client.post("/v1/episodes", json={"index": 1, "split": None, "task_id": None})
    assert alone.status_code == 422
    spec = (await client.get("/openapi.json")).json()
    shapes = spec["components"]["schemas"]["TaskSelection"]["anyOf"]
    assert {tuple(shape.get("required", ())) for shape in shapes} == {("task_id",), ("split", "index"), ()}


# -- a close racing a step ---------------------------------------------------------------------------------


class FragileEnv(CountdownEnv):
    """Like the real engines: closing the instance under a running step breaks that step."""

    def __init__(self) -> None:
        super().__init__()
        self.is_closed = False
        self.closed_during_step = False
        self.stepping = threading.Event()

    def step(self, action: str) -> StepResult:
        self.stepping.set()
        result = super().step(action)
        if self.is_closed:
            self.closed_during_step = True
        assert not self.is_closed, "stepped a closed instance"
        return result

    def close(self) -> None:
        self.is_closed = True
        super().close()


@pytest.fixture
async def fragile() -> AsyncIterator[tuple[httpx.AsyncClient, EpisodeManager]]:
    manager = EpisodeManager(
        "countdown", FragileEnv, CountdownCatalog(), ManagerConfig(max_episodes=4, step_timeout_s=5, worker_threads=4)
    )
    await manager.start()
    app = create_app(manager, compat=False, manage_lifecycle=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env") as c:
        yield c, manager
    await manager.stop()


async def test_closing_during_a_step_answers_the_step_409_not_an_environment_failure(
    fragile: tuple[httpx.AsyncClient, EpisodeManager],
) -> None:
    client, manager = fragile
    episode = await _episode(client)
    env = manager.get(episode).env
    assert isinstance(env, FragileEnv)
    failed_before = _total(manager, "agentgym_env_episodes_failed_total")

    stepping = asyncio.create_task(client.post(f"/v1/episodes/{episode}/step", json={"action": "hang 0.4"}))
    queued = asyncio.create_task(client.post(f"/v1/episodes/{episode}/step", json={"action": "tick"}))
    await asyncio.to_thread(env.stepping.wait, 5)
    closed = await client.delete(f"/v1/episodes/{episode}")
    assert closed.status_code == 204
    assert manager.live_episodes == 0  # its place under the cap is free at once
    assert not env.is_closed  # ... but the instance is closed only once the step is done with it

    step, waiting = await stepping, await queued
    assert step.status_code == 409 and "was closed" in step.json()["detail"], step.text
    assert waiting.status_code in (404, 409) and "failed" not in waiting.text
    await asyncio.sleep(0.1)  # closing happens on a worker thread
    assert env.is_closed and not env.closed_during_step
    assert _total(manager, "agentgym_env_episodes_failed_total") == failed_before
    assert (await client.get(f"/v1/episodes/{episode}")).status_code == 404


async def test_closing_during_a_step_in_process() -> None:
    manager = EpisodeManager("countdown", FragileEnv, CountdownCatalog(), ManagerConfig(step_timeout_s=5))
    await manager.start()
    try:
        episode, _ = await manager.open("count/2")
        stepping = asyncio.create_task(manager.step(episode.episode_id, "hang 0.3"))
        await asyncio.to_thread(episode.env.stepping.wait, 5)  # type: ignore[attr-defined]
        await manager.close(episode.episode_id)
        with pytest.raises(EpisodeClosedError):
            await stepping
    finally:
        await manager.stop()


# -- episodes opened and never stepped -------------------------------------------------------------------


async def test_episodes_never_stepped_are_reaped_sooner() -> None:
    manager = make_manager(idle_timeout_s=600, never_stepped_timeout_s=0.2, reap_interval_s=0.05)
    await manager.start()
    try:
        forgotten, _ = await manager.open("count/3")
        played, _ = await manager.open("count/3")
        untasked, _ = await manager.open(None)
        await manager.step(played.episode_id, "tick")
        await asyncio.sleep(0.6)
        assert manager.live_episodes == 1
        manager.get(played.episode_id)  # a stepped episode waits for the idle timeout
        for gone in (forgotten, untasked):
            with pytest.raises(LookupError):
                manager.get(gone.episode_id)
        reaped = manager.metrics.registry.get_sample_value(
            "agentgym_env_episodes_closed_total", {"environment": "countdown", "reason": "never_stepped"}
        )
        assert reaped == 2
    finally:
        await manager.stop()


# -- the OpenAPI document says what each route answers ---------------------------------------------------------


EXPECTED_STATUSES: dict[tuple[str, str], set[str]] = {
    ("post", "/v1/episodes"): {"201", "404", "413", "422", "429", "500"},
    ("post", "/v1/episodes/{episode_id}/reset"): {"200", "404", "409", "413", "422", "429", "500"},
    ("post", "/v1/episodes/{episode_id}/step"): {"200", "404", "409", "413", "422"},
    ("get", "/v1/episodes/{episode_id}"): {"200", "404", "422"},
    ("get", "/v1/episodes/{episode_id}/actions"): {"200", "404", "409", "422"},
    ("delete", "/v1/episodes/{episode_id}"): {"204", "404", "422"},
    ("get", "/v1/tasks"): {"200", "404", "422"},
    ("get", "/v1/tasks/{task_id}"): {"200", "404", "422"},
    ("post", "/step"): {"200", "404", "409", "413", "422"},
    ("post", "/reset"): {"200", "404", "409", "413", "422", "429", "500"},
    ("post", "/close"): {"200", "404", "413", "422"},
    ("get", "/observation"): {"200", "404", "422"},
}


async def test_openapi_declares_every_status_and_metrics_as_text() -> None:
    async with running_service("babyai") as (client, _, _):
        spec = (await client.get("/openapi.json")).json()
        for (method, path), statuses in EXPECTED_STATUSES.items():
            assert set(spec["paths"][path][method]["responses"]) == statuses, (method, path)
        metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
        assert list(metrics) == ["text/plain"]
        served = await client.get("/metrics")
        assert served.headers["content-type"].startswith("text/plain")


async def test_a_405_lists_every_method_of_the_path(client: httpx.AsyncClient) -> None:
    episode = await _episode(client)
    for method in ("OPTIONS", "PUT", "PATCH"):
        refused = await client.request(method, f"/v1/episodes/{episode}")
        assert refused.status_code == 405
        assert {m.strip() for m in refused.headers["allow"].split(",")} == {"GET", "DELETE"}, method
    post_only = await client.get("/v1/episodes")
    assert post_only.status_code == 405 and post_only.headers["allow"] == "POST"


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


async def test_error_bodies_are_always_encodable(client: httpx.AsyncClient) -> None:
    """Whatever reaches an error message (ids, keys, values), the response is valid UTF-8 JSON."""
    for path, body in [
        ("/v1/episodes", b'{"task_id": "\\ud83d"}'),
        ("/v1/episodes", b'{"split": "\\udc00", "index": 0}'),
        ("/v1/episodes/%ED%A0%80/step", b'{"action": "tick"}'),
        ("/v1/episodes", b'{"task_id": '),
    ]:
        response = await client.post(path, content=body, headers=JSON)
        assert 400 <= response.status_code < 500, (path, response.status_code)
        for text in _strings(json.loads(response.content.decode("utf-8"))):
            text.encode("utf-8")
