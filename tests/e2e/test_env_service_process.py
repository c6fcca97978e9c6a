"""The environment service as users run it: `agentgym env serve` in its own process, HTTP + gRPC on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from agentgym.envs import make_expert
from agentgym.envs.client import EnvClient, EnvServiceError
from agentgym.messaging import free_port
from agentgym.proto import env_pb2, env_pb2_grpc

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]


@pytest.fixture(scope="module")
def textcraft_service() -> Iterator[tuple[str, str]]:
    http_port, grpc_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            *AGENTGYM,
            "env",
            "serve",
            "textcraft",
            "--port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--max-episodes",
            "4",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        try:
            httpx.get(f"{url}/healthz", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "service did not become healthy"
            time.sleep(0.1)
    yield url, f"127.0.0.1:{grpc_port}"
    process.terminate()
    assert process.wait(timeout=15) == 0  # clean shutdown on SIGTERM
    if process.stdout:
        assert process.stdout.read() == b""  # nothing chatters on stdout
        process.stdout.close()
    if process.stderr:
        process.stderr.close()


def test_expert_over_http_and_grpc_in_one_process(textcraft_service: tuple[str, str]) -> None:
    url, grpc_target = textcraft_service
    with EnvClient(url) as client:
        assert client.health()["environment"] == "textcraft"
        task_id = client.task_ids("test", limit=1)[0]
        actions = make_expert("textcraft").demonstrate(task_id)
        opened = client.create(task_id=task_id)
        for action in actions:
            result = client.step(opened.episode_id, action)
        assert result.done and result.info["success"]
        client.close(opened.episode_id)
        with pytest.raises(EnvServiceError) as missing:
            client.step(opened.episode_id, "inventory")
        assert missing.value.status == 404

    async def over_grpc() -> None:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = env_pb2_grpc.EnvServiceStub(channel)
            health = await stub.Health(env_pb2.HealthRequest())
            assert health.environment == "textcraft" and health.max_episodes == 4
            opened = await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=env_pb2.TaskSelector(task_id=task_id)))
            for action in actions:
                reply = await stub.Step(env_pb2.StepRequest(episode_id=opened.episode_id, action=action))
            assert reply.done and reply.reward == 1.0

    import asyncio

    asyncio.run(over_grpc())


def test_cap_is_enforced_across_protocols(textcraft_service: tuple[str, str]) -> None:
    url, _ = textcraft_service
    with EnvClient(url) as client:
        live = client.health()["live_episodes"]
        opened = [client.create(split="test", index=0) for _ in range(4 - live)]
        with pytest.raises(EnvServiceError) as full:
            client.create(split="test", index=0)
        assert full.value.status == 429
        for episode in opened:
            client.close(episode.episode_id)


def test_cli_play_solves_a_task_through_a_served_environment() -> None:
    result = subprocess.run(
        [*AGENTGYM, "env", "play", "textcraft", "--split", "test", "--index", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "success=True" in result.stdout and "Crafted" in result.stdout


def test_cli_rejects_bad_input_clearly() -> None:
    unknown = subprocess.run([*AGENTGYM, "env", "serve", "chess"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown environment 'chess'" in unknown.stderr
    bad_task = subprocess.run(
        [*AGENTGYM, "env", "play", "textcraft", "--task-id", "craft/nothing"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_task.returncode == 2 and "craft/nothing" in bad_task.stderr
    for setting, reason in [("list_actions=maybe", "list_actions must be true or false"), ("bogus=1", "'bogus'")]:
        rejected = subprocess.run(
            [*AGENTGYM, "env", "serve", "babyai", "--port", str(free_port()), "--set", setting],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert rejected.returncode == 2, rejected.stderr[-2000:]
        assert "--set: babyai: bad settings" in rejected.stderr and reason in " ".join(rejected.stderr.split())
