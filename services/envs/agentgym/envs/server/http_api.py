"""FastAPI front end of an environment service (OpenAPI docs at /docs).

Native routes live under /v1; AgentGym's original routes (/create, /step, ...) are mounted at the
root by `agentgym.envs.server.compat` so existing AgentGym clients work unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from agentgym.envs.base import ResetResult, StepResult, UnknownTaskError
from agentgym.envs.server.limits import ActionText, BodyIndex, BodySizeLimit, NameText, safe_text
from agentgym.envs.server.manager import (
    CapacityError,
    EnvironmentCrashError,
    EpisodeManager,
    EpisodeNotFoundError,
    EpisodeStateError,
)

# The schema of a task selection, beside its fields': a task id, or a split with an index, or nothing
# (null is the same as absent). It says what `_one_way` checks, so a client reading the schema (or a
# fuzzer generating from it) is not led to send `{"index": 1}` alone and be refused.
_SELECTION_SHAPES: dict[str, Any] = {
    "anyOf": [
        {
            "required": ["task_id"],
            "properties": {"task_id": {"type": "string"}, "split": {"type": "null"}, "index": {"type": "null"}},
        },
        {
            "required": ["split", "index"],
            "properties": {"task_id": {"type": "null"}, "split": {"type": "string"}, "index": {"type": "integer"}},
        },
        {"properties": {"task_id": {"type": "null"}, "split": {"type": "null"}, "index": {"type": "null"}}},
    ]
}


class TaskSelection(BaseModel):
    """Name a task by id, or by split and index."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_SELECTION_SHAPES)
    task_id: NameText | None = Field(default=None, description="Task id from GET /v1/tasks")
    split: NameText | None = Field(default=None, description="Split name (with index)")
    index: BodyIndex | None = Field(default=None, description="Position in the split")

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
    action: ActionText = Field(description="One bare action, e.g. 'turn left'")


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


class ErrorOut(BaseModel):
    """An error: `detail` says what went wrong (`error` repeats it, as AgentGym's routes answer)."""

    detail: str
    error: str | None = None


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` for the error statuses a route can answer."""
    described = {
        404: "Unknown episode or task",
        409: "The episode cannot take this call now (no task yet, finished, failed, or closed meanwhile)",
        413: "Request body too large",
        429: "Live-episode cap reached, or the environment is out of capacity; retry later",
        500: "The environment crashed starting or resetting the episode",
    }
    return {status: {"model": ErrorOut, "description": described[status]} for status in statuses}


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


def validation_payload(error: RequestValidationError) -> dict[str, Any]:
    """A 422 body naming each bad field. The input is not echoed back: it may be huge, or not even
    encodable (a lone surrogate), and an error handler must never fail on what it reports."""
    detail = []
    parts = []
    for item in error.errors():
        loc = [p if isinstance(p, int) else safe_text(p, 100) for p in item.get("loc", ())]
        msg = safe_text(item.get("msg", "invalid"))
        detail.append({"loc": loc, "msg": msg, "type": safe_text(item.get("type", "value_error"), 100)})
        field = ".".join(str(p) for p in loc[1:] if not isinstance(p, int)) if loc[:1] == ["body"] else ""
        where = field or ".".join(str(p) for p in loc) or "body"
        parts.append(f"{where}: {msg}")
    return {"detail": detail, "error": "invalid request: " + "; ".join(parts)}


def allowed_methods(app: FastAPI, scope: dict[str, Any]) -> list[str]:
    """Every method some route of `app` answers at the request's path (a 405's Allow header)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Map the manager's errors onto HTTP statuses with a readable `detail`."""

    def handler(status: int, headers: dict[str, str] | None = None) -> Any:
        async def handle(_: Request, error: Exception) -> JSONResponse:
            return JSONResponse({"detail": safe_text(error, 2_000)}, status_code=status, headers=headers)

        return handle

    async def invalid(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        return JSONResponse(validation_payload(error), status_code=422)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        if error.status_code == 400 and isinstance(error.__cause__, ValueError):
            # FastAPI answers a body it cannot even decode (not UTF-8) with a bare 400; it is malformed
            # JSON like any other, a 422 naming the body.
            message = f"the body is not UTF-8 JSON: {safe_text(error.__cause__, 200)}"
            detail = [{"loc": ["body"], "msg": message, "type": "json_invalid"}]
            return JSONResponse({"detail": detail, "error": f"invalid request: body: {message}"}, status_code=422)
        headers = dict(error.headers or {})
        if error.status_code == 405:
            # Starlette names only the first route matching the path; a path served by several routes
            # (GET and DELETE /v1/episodes/{id}) must list all of their methods.
            headers["Allow"] = ", ".join(allowed_methods(app, dict(request.scope)))
        if error.status_code in (204, 304):
            return Response(status_code=error.status_code, headers=headers)
        return JSONResponse({"detail": safe_text(error.detail, 2_000)}, status_code=error.status_code, headers=headers)

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)

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
    app.add_middleware(BodySizeLimit)

    @app.post(
        "/v1/episodes",
        response_model=EpisodeOut,
        status_code=201,
        tags=["episodes"],
        responses=_errors(404, 413, 429, 500),
    )
    async def create_episode(body: TaskSelection | None = None) -> dict[str, Any]:
        """Open an episode; with a task it is reset to it and the first observation returned."""
        task_id = None
        if body is not None and body.given():
            task_id = manager.resolve_task(body.task_id, body.split, body.index)
        episode, first = await manager.open(task_id)
        return episode_out(episode.episode_id, task_id, first)

    @app.post(
        "/v1/episodes/{episode_id}/reset",
        response_model=EpisodeOut,
        tags=["episodes"],
        responses=_errors(404, 409, 413, 429, 500),
    )
    async def reset_episode(episode_id: str, body: TaskSelection) -> dict[str, Any]:
        """Reset an episode to a task (the same or another)."""
        manager.get(episode_id)
        task_id = manager.resolve_task(body.task_id, body.split, body.index)
        first = await manager.reset(episode_id, task_id)
        return episode_out(episode_id, task_id, first)

    @app.post(
        "/v1/episodes/{episode_id}/step", response_model=StepOut, tags=["episodes"], responses=_errors(404, 409, 413)
    )
    async def step_episode(episode_id: str, body: StepIn) -> dict[str, Any]:
        """Take one action. A crashed environment ends the episode: done with info.failed and info.error."""
        return step_out(await manager.step(episode_id, body.action))

    @app.get("/v1/episodes/{episode_id}", response_model=ObserveOut, tags=["episodes"], responses=_errors(404))
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

    @app.get(
        "/v1/episodes/{episode_id}/actions", response_model=ActionsOut, tags=["episodes"], responses=_errors(404, 409)
    )
    async def episode_actions(episode_id: str) -> dict[str, Any]:
        """Actions valid now (null when the environment does not list them)."""
        return {"available_actions": await manager.available_actions(episode_id)}

    @app.delete(
        "/v1/episodes/{episode_id}",
        status_code=204,
        response_class=Response,
        tags=["episodes"],
        responses=_errors(404),
    )
    async def close_episode(episode_id: str) -> Response:
        """Close an episode. A step still running on it is answered 409 (the episode was closed)."""
        await manager.close(episode_id)
        return Response(status_code=204)

    @app.get("/v1/tasks", response_model=TasksOut, tags=["tasks"], responses=_errors(404))
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

    @app.get("/v1/tasks/{task_id:path}", tags=["tasks"], responses=_errors(404))
    async def describe_task(task_id: str) -> dict[str, Any]:
        """A task's metadata (split, level or goal, difficulty, ...)."""
        return {"task_id": task_id, **manager.catalog.describe(task_id)}

    @app.get("/healthz", response_model=HealthOut, tags=["ops"])
    async def health() -> dict[str, Any]:
        return {
            "status": "ok" if manager.healthy() else "degraded",
            "environment": env,
            "live_episodes": manager.live_episodes,
            "max_episodes": manager.config.max_episodes,
        }

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus metrics, in Prometheus' text format."""
        return PlainTextResponse(generate_latest(manager.metrics.registry), media_type=CONTENT_TYPE_LATEST)

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
