"""gRPC front end (agentgym.v1.EnvService) with the same semantics as the HTTP API."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import json_format, struct_pb2

from agentgym.envs.base import ResetResult, StepResult, UnknownTaskError
from agentgym.envs.server.limits import MAX_ACTION_CHARS, MAX_BODY_BYTES
from agentgym.envs.server.manager import (
    CapacityError,
    EnvironmentCrashError,
    EpisodeClosedError,
    EpisodeManager,
    EpisodeNotFoundError,
    EpisodeStateError,
)
from agentgym.proto import env_pb2, env_pb2_grpc

T = TypeVar("T")

_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (EpisodeNotFoundError, grpc.StatusCode.NOT_FOUND),
    (UnknownTaskError, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EpisodeClosedError, grpc.StatusCode.ABORTED),  # a concurrent close: before its base class below
    (EpisodeStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (EnvironmentCrashError, grpc.StatusCode.INTERNAL),
]


def to_struct(info: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    if info:
        json_format.ParseDict(_jsonable(info), struct)
    return struct


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def episode_reply(episode_id: str, task_id: str | None, result: ResetResult | None) -> env_pb2.EpisodeReply:
    if result is None:
        return env_pb2.EpisodeReply(episode_id=episode_id, task_id=task_id or "")
    return env_pb2.EpisodeReply(
        episode_id=episode_id,
        task_id=task_id or "",
        observation=result.observation,
        available_actions=result.available_actions or [],
        has_available_actions=result.available_actions is not None,
        info=to_struct(result.info),
    )


def step_reply(result: StepResult) -> env_pb2.StepReply:
    return env_pb2.StepReply(
        observation=result.observation,
        reward=result.reward,
        score=result.score,
        done=result.done,
        truncated=result.truncated,
        available_actions=result.available_actions or [],
        has_available_actions=result.available_actions is not None,
        info=to_struct(result.info),
    )


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager

    async def _guard(self, context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except Exception as error:
            for kind, code in _CODES:
                if isinstance(error, kind):
                    await _abort(context, code, str(error))
            raise

    def _selected_task(self, selector: env_pb2.TaskSelector) -> str | None:
        which = selector.WhichOneof("selector")
        if which == "task_id":
            return self.manager.resolve_task(task_id=selector.task_id)
        if which == "split_index":
            return self.manager.resolve_task(split=selector.split_index.split, index=selector.split_index.index)
        return None

    async def CreateEpisode(
        self, request: env_pb2.CreateEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.EpisodeReply:
        async def run() -> env_pb2.EpisodeReply:
            task_id = self._selected_task(request.task)
            episode, first = await self.manager.open(task_id)
            return episode_reply(episode.episode_id, task_id, first)

        return await self._guard(context, run)

    async def ResetEpisode(
        self, request: env_pb2.ResetEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.EpisodeReply:
        async def run() -> env_pb2.EpisodeReply:
            self.manager.get(request.episode_id)
            task_id = self._selected_task(request.task)
            if task_id is None:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "name a task: task_id or split_index")
            assert task_id is not None
            first = await self.manager.reset(request.episode_id, task_id)
            return episode_reply(request.episode_id, task_id, first)

        return await self._guard(context, run)

    async def Step(self, request: env_pb2.StepRequest, context: grpc.aio.ServicerContext) -> env_pb2.StepReply:
        async def run() -> env_pb2.StepReply:
            if len(request.action) > MAX_ACTION_CHARS:  # the HTTP routes' limit, before any work
                await _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"action: at most {MAX_ACTION_CHARS} characters, not {len(request.action)}",
                )
            return step_reply(await self.manager.step(request.episode_id, request.action))

        return await self._guard(context, run)

    async def Observe(self, request: env_pb2.EpisodeRef, context: grpc.aio.ServicerContext) -> env_pb2.ObserveReply:
        async def run() -> env_pb2.ObserveReply:
            e = await self.manager.observe(request.episode_id)
            return env_pb2.ObserveReply(
                episode_id=e.episode_id,
                task_id=e.task_id or "",
                observation=e.observation,
                status=e.status,
                steps=e.steps,
                score=e.score,
            )

        return await self._guard(context, run)

    async def CloseEpisode(self, request: env_pb2.EpisodeRef, context: grpc.aio.ServicerContext) -> env_pb2.CloseReply:
        async def run() -> env_pb2.CloseReply:
            await self.manager.close(request.episode_id)
            return env_pb2.CloseReply(closed=True)

        return await self._guard(context, run)

    async def ListTasks(
        self, request: env_pb2.ListTasksRequest, context: grpc.aio.ServicerContext
    ) -> env_pb2.ListTasksReply:
        async def run() -> env_pb2.ListTasksReply:
            splits = self.manager.catalog.splits()
            reply = env_pb2.ListTasksReply(splits=splits)
            if request.split:
                if request.split not in splits:
                    raise UnknownTaskError(f"unknown split {request.split!r}; splits are {sorted(splits)}")
                limit = request.limit or 1000
                end = min(request.offset + limit, splits[request.split])
                reply.task_ids.extend(
                    self.manager.catalog.task_id(request.split, i) for i in range(request.offset, end)
                )
            return reply

        return await self._guard(context, run)

    async def Health(self, request: env_pb2.HealthRequest, context: grpc.aio.ServicerContext) -> env_pb2.HealthReply:
        return env_pb2.HealthReply(
            status="ok" if self.manager.healthy() else "degraded",
            environment=self.manager.environment,
            live_episodes=self.manager.live_episodes,
            max_episodes=self.manager.config.max_episodes,
        )


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


def create_grpc_server(manager: EpisodeManager, address: str) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to `address` ("host:0" picks a free port) and the port it got.

    Call `await server.start()` to serve.
    """
    # Messages are capped like HTTP bodies (gRPC's own default is 4 MiB).
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_BODY_BYTES)])
    env_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(manager), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    return server, port
