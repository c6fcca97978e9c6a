"""gRPC contract: same semantics as HTTP, errors as gRPC status codes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from countdown_env import make_manager
from google.protobuf import json_format

from agentgym.envs.server.grpc_api import create_grpc_server
from agentgym.envs.server.limits import MAX_ACTION_CHARS
from agentgym.envs.server.manager import EpisodeManager
from agentgym.proto import env_pb2, env_pb2_grpc


@pytest.fixture
async def stub_and_manager() -> AsyncIterator[tuple[env_pb2_grpc.EnvServiceStub, EpisodeManager]]:
    manager = make_manager(max_episodes=3)
    await manager.start()
    server, port = create_grpc_server(manager, "127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield env_pb2_grpc.EnvServiceStub(channel), manager
    await server.stop(grace=None)
    await manager.stop()


def _task(task_id: str) -> env_pb2.TaskSelector:
    return env_pb2.TaskSelector(task_id=task_id)


async def test_lifecycle(stub_and_manager: tuple[env_pb2_grpc.EnvServiceStub, EpisodeManager]) -> None:
    stub, _ = stub_and_manager
    opened = await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=_task("count/2")))
    assert opened.observation == "Say tick 2 times." and opened.task_id == "count/2"
    assert list(opened.available_actions) == ["tick"] and opened.has_available_actions
    step = await stub.Step(env_pb2.StepRequest(episode_id=opened.episode_id, action="tick"))
    assert step.observation == "1 to go." and not step.done
    assert json_format.MessageToDict(step.info) == {"invalid_action": False, "success": False}
    final = await stub.Step(env_pb2.StepRequest(episode_id=opened.episode_id, action="tick"))
    assert final.done and final.reward == 1.0 and final.score == 1.0
    observed = await stub.Observe(env_pb2.EpisodeRef(episode_id=opened.episode_id))
    assert observed.status == "done" and observed.steps == 2
    assert (await stub.CloseEpisode(env_pb2.EpisodeRef(episode_id=opened.episode_id))).closed


async def test_split_index_reset_and_listing(
    stub_and_manager: tuple[env_pb2_grpc.EnvServiceStub, EpisodeManager],
) -> None:
    stub, _ = stub_and_manager
    selector = env_pb2.TaskSelector(split_index=env_pb2.SplitIndex(split="test", index=1))
    opened = await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=selector))
    assert opened.task_id == "count/102"
    reset = await stub.ResetEpisode(env_pb2.ResetEpisodeRequest(episode_id=opened.episode_id, task=_task("count/1")))
    assert reset.observation == "Say tick 1 times."
    listing = await stub.ListTasks(env_pb2.ListTasksRequest(split="train", offset=0, limit=3))
    assert dict(listing.splits) == {"train": 20, "test": 5}
    assert list(listing.task_ids) == ["count/1", "count/2", "count/3"]
    health = await stub.Health(env_pb2.HealthRequest())
    assert health.status == "ok" and health.live_episodes == 1 and health.max_episodes == 3


async def test_error_codes(stub_and_manager: tuple[env_pb2_grpc.EnvServiceStub, EpisodeManager]) -> None:
    stub, _ = stub_and_manager
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await stub.Step(env_pb2.StepRequest(episode_id="missing", action="tick"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "missing" in (unknown.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as bad_task:
        await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=_task("count/0")))
    assert bad_task.value.code() == grpc.StatusCode.NOT_FOUND
    opened = [await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=_task("count/5"))) for _ in range(3)]
    with pytest.raises(grpc.aio.AioRpcError) as full:
        await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=_task("count/5")))
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    crashed = await stub.Step(env_pb2.StepRequest(episode_id=opened[0].episode_id, action="crash"))
    assert crashed.done and json_format.MessageToDict(crashed.info)["failed"] is True
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.Step(env_pb2.StepRequest(episode_id=opened[0].episode_id, action="tick"))
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    invalid = await stub.Step(env_pb2.StepRequest(episode_id=opened[1].episode_id, action="jump"))
    assert json_format.MessageToDict(invalid.info)["invalid_action"] is True
    with pytest.raises(grpc.aio.AioRpcError) as no_task:
        await stub.ResetEpisode(env_pb2.ResetEpisodeRequest(episode_id=opened[1].episode_id))
    assert no_task.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_action_limit_is_the_http_one(
    stub_and_manager: tuple[env_pb2_grpc.EnvServiceStub, EpisodeManager],
) -> None:
    stub, manager = stub_and_manager
    opened = await stub.CreateEpisode(env_pb2.CreateEpisodeRequest(task=_task("count/2")))
    with pytest.raises(grpc.aio.AioRpcError) as too_long:
        await stub.Step(env_pb2.StepRequest(episode_id=opened.episode_id, action="x" * (MAX_ACTION_CHARS + 1)))
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "action" in (too_long.value.details() or "")
    assert manager.get(opened.episode_id).steps == 0
    at_limit = await stub.Step(env_pb2.StepRequest(episode_id=opened.episode_id, action="x" * MAX_ACTION_CHARS))
    assert json_format.MessageToDict(at_limit.info)["invalid_action"] is True
