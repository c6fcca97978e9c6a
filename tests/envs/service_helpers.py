"""Helpers for driving a real environment kind through its service (HTTP in-process, gRPC on loopback)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import httpx

from agentgym.envs.server.grpc_api import create_grpc_server
from agentgym.envs.server.http_api import create_app
from agentgym.envs.server.manager import EpisodeManager, ManagerConfig
from agentgym.envs.server.runner import build_manager
from agentgym.proto import env_pb2_grpc


@asynccontextmanager
async def running_service(
    environment: str, env_config: dict[str, Any] | None = None, **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, env_pb2_grpc.EnvServiceStub, EpisodeManager]]:
    """The environment's manager behind both front ends: an in-process HTTP client and a gRPC stub."""
    manager = build_manager(environment, ManagerConfig(**config), env_config)
    await manager.start()
    app = create_app(manager, manage_lifecycle=False)
    server, port = create_grpc_server(manager, "127.0.0.1:0")
    await server.start()
    try:
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env", timeout=60) as client,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            yield client, env_pb2_grpc.EnvServiceStub(channel), manager
    finally:
        await server.stop(grace=None)
        await manager.stop()


async def play_http(client: httpx.AsyncClient, task_id: str, actions: list[str]) -> dict[str, Any]:
    """Replay `actions` on a new episode over the native HTTP API; returns the last step's body."""
    created = await client.post("/v1/episodes", json={"task_id": task_id})
    assert created.status_code == 201, created.text
    episode_id = created.json()["episode_id"]
    last: dict[str, Any] = {}
    for action in actions:
        response = await client.post(f"/v1/episodes/{episode_id}/step", json={"action": action})
        assert response.status_code == 200, response.text
        last = response.json()
        if last["done"] or last["truncated"]:
            break
    assert (await client.delete(f"/v1/episodes/{episode_id}")).status_code == 204
    return last
