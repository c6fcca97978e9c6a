"""FastAPI front end of an environment service (OpenAPI docs at /docs).

Native routes live under /v1; AgentGym's original routes (/create, /step, ...) are mounted at the
root by `agentgym.envs.server.compat` so existing AgentGym clients work unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentgym.envs.base import ResetResult, StepResult, UnknownTaskError
from agentgym.envs.server.manager import (
    CapacityError,
    EnvironmentCrashError,
    EpisodeManager,
    EpisodeNotFoundError,
    EpisodeStateError,
)


class TaskSelection(BaseModel):
    """Name a task by id, or by split and index."""

    model_config = ConfigDict(extra="forbid")
    task_id: str | None = Field(default=None, description="Task id from GET /v1/tasks")
    split: str | None = Field(default=None, description="Split name (with index)")
    index: int | None = Field(default=None, ge=0, description="Position in the split")

    @model_validator(mode="after")
    def _one_way(self) -> TaskSelection:
        if self.task_id is not None and (self.split is not None or self.index is not None):
            raise ValueError("give task_id, or split and index, not both")
        if (self.split is None) != (self.index is None):
            raise ValueError("split and index go together")
        return self

    def given(self) -> bool:
        return self.task_id is not None or self.split is not None


class EpisodeOut(BaseModel):
    episode_id: str
    task_id: str | None
    observation: str
    available_actions: list[str] | None = None
    info: dict[str, Any] = Field(default_factory=dict)


class StepIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: str = Field(description="One bare action, e.g. 'turn left'", max_length=16_384)


class StepOut(BaseModel):
    observation: str
    reward: float
    score: float
    done: bool
    truncated: bool
    available_actions: list[str] | None = None
    info: dict[str, Any] = Field(default_factory=dict)


class ObserveOut(BaseModel):
    episode_id: str
    task_id: str | None
    observation: str
    status: str
    steps: int
    score: float
    failure: str | None = None


class ActionsOut(BaseModel):
    available_actions: list[str] | None


class TasksOut(BaseModel):
    splits: dict[str, int]
    split: str | None = None
    offset: int = 0
    task_ids: list[str] = Field(default_factory=list)


class HealthOut(BaseModel):
    status: str
    environment: str
    live_episodes: int
    max_episodes: int


def episode_out(episode_id: str, task_id: str | None, result: ResetResult | None) -> dict[str, Any]:
    if result is None:
        return {
            "episode_id": episode_id,
            "task_id": task_id,
            "observation": "",
            "available_actions": None,
            "info": {},
        }
    return {
        "episode_id": episode_id,
        "task_id": task_id,
        "observation": result.observation,
        "available_actions": result.available_actions,
        "info": result.info,
    }


def step_out(result: StepResult) -> dict[str, Any]:
    return {
        "observation": result.observation,
        "reward": result.reward,
        "score": result.score,
        "done": result.done,
        "truncated": result.truncated,
        "available_actions": result.available_actions,
        "info": result.info,
    }


def install_error_handlers(app: FastAPI) -> None:
    """Map the manager's errors onto HTTP statuses with a readable `detail`."""

    def handler(status: int, headers: dict[str, str] | None = None) -> Any:
        async def handle(_: Request, error: Exception) -> JSONResponse:
            return JSONResponse({"detail": str(error)}, status_code=status, headers=headers)

        return handle

    app.add_exception_handler(EpisodeNotFoundError, handler(404))
    app.add_exception_handler(UnknownTaskError, handler(404))
    app.add_exception_handler(CapacityError, handler(429, {"Retry-After": "1"}))
    app.add_exception_handler(EpisodeStateError, handler(409))
    app.add_exception_handler(EnvironmentCrashError, handler(500))


def create_app(manager: EpisodeManager, *, compat: bool = True, manage_lifecycle: bool = True) -> FastAPI:
    """The HTTP app over `manager`. With `manage_lifecycle`, the app starts/stops the manager."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await manager.start()
        yield
        if manage_lifecycle:
            await manager.stop()

    env = manager.environment
    app = FastAPI(
        title=f"AgentGym {env} environment service",
        version="v1",
        description=f"Episodes of the {env} environment. Native API under /v1; AgentGym routes at the root.",
        lifespan=lifespan,
    )
    app.state.manager = manager
    install_error_handlers(app)

    @app.post("/v1/episodes", response_model=EpisodeOut, status_code=201, tags=["episodes"])
    async def create_episode(body: TaskSelection | None = None) -> dict[str, Any]:
        """Open an episode; with a task it is reset to it and the first observation returned."""
        task_id = None
        if body is not None and body.given():
            task_id = manager.resolve_task(body.task_id, body.split, body.index)
        episode, first = await manager.open(task_id)
        return episode_out(episode.episode_id, task_id, first)

    @app.post("/v1/episodes/{episode_id}/reset", response_model=EpisodeOut, tags=["episodes"])
    async def reset_episode(episode_id: str, body: TaskSelection) -> dict[str, Any]:
        """Reset an episode to a task (the same or another)."""
        manager.get(episode_id)
        task_id = manager.resolve_task(body.task_id, body.split, body.index)
        first = await manager.reset(episode_id, task_id)
        return episode_out(episode_id, task_id, first)

    @app.post("/v1/episodes/{episode_id}/step", response_model=StepOut, tags=["episodes"])
    async def step_episode(episode_id: str, body: StepIn) -> dict[str, Any]:
        """Take one action. A crashed environment ends the episode: done with info.failed and info.error."""
        return step_out(await manager.step(episode_id, body.action))

    @app.get("/v1/episodes/{episode_id}", response_model=ObserveOut, tags=["episodes"])
    async def observe_episode(episode_id: str) -> dict[str, Any]:
        """The current observation and state, without acting."""
        e = await manager.observe(episode_id)
        return {
            "episode_id": e.episode_id,
            "task_id": e.task_id,
            "observation": e.observation,
            "status": e.status,
            "steps": e.steps,
            "score": e.score,
            "failure": e.failure,
        }

    @app.get("/v1/episodes/{episode_id}/actions", response_model=ActionsOut, tags=["episodes"])
    async def episode_actions(episode_id: str) -> dict[str, Any]:
        """Actions valid now (null when the environment does not list them)."""
        return {"available_actions": await manager.available_actions(episode_id)}

    @app.delete("/v1/episodes/{episode_id}", status_code=204, tags=["episodes"])
    async def close_episode(episode_id: str) -> Response:
        await manager.close(episode_id)
        return Response(status_code=204)

    @app.get("/v1/tasks", response_model=TasksOut, tags=["tasks"])
    async def list_tasks(
        split: str | None = None,
        offset: int = Query(default=0, ge=0),
        limit: int = Query(default=100, ge=1, le=10_000),
    ) -> dict[str, Any]:
        """Split sizes; with `split`, a page of its task ids."""
        splits = manager.catalog.splits()
        if split is None:
            return {"splits": splits}
        if split not in splits:
            raise UnknownTaskError(f"unknown split {split!r}; splits are {sorted(splits)}")
        end = min(offset + limit, splits[split])
        ids = [manager.catalog.task_id(split, i) for i in range(offset, end)]
        return {"splits": splits, "split": split, "offset": offset, "task_ids": ids}

    @app.get("/v1/tasks/{task_id:path}", tags=["tasks"])
    async def describe_task(task_id: str) -> dict[str, Any]:
        return {"task_id": task_id, **manager.catalog.describe(task_id)}

    @app.get("/healthz", response_model=HealthOut, tags=["ops"])
    async def health() -> dict[str, Any]:
        return {
            "status": "ok" if manager.healthy() else "degraded",
            "environment": env,
            "live_episodes": manager.live_episodes,
            "max_episodes": manager.config.max_episodes,
        }

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        return Response(generate_latest(manager.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if compat:
        from agentgym.envs.server.compat import compat_router

        router = compat_router(env, manager)
        if router is not None:
            app.include_router(router)
        else:

            @app.get("/", response_class=PlainTextResponse, include_in_schema=False)
            async def hello() -> str:
                return f"This is environment {env}."

    return app
