"""AgentGym-compatible routes: each environment's original paths and field names.

AgentGym's servers address episodes by small integers and pick tasks by `data_idx`; this module
keeps an int -> episode id table per service and lets each environment kind declare its routes in
`agentgym.envs.<kind>.compat.build_router(manager, ids)`. Errors keep proper HTTP statuses and
carry AgentGym's `error` field beside `detail`, so both kinds of client can read them.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from agentgym.envs.base import UnknownTaskError
from agentgym.envs.server.limits import ActionText, BodyIndex, BodyInt, safe_text
from agentgym.envs.server.manager import (
    CapacityError,
    EnvironmentCrashError,
    EpisodeManager,
    EpisodeNotFoundError,
    EpisodeStateError,
)

T = TypeVar("T")

# Environment kinds with AgentGym routes: name -> module defining build_router(manager, ids).
COMPAT_MODULES: dict[str, str] = {
    "babyai": "agentgym.envs.babyai.compat",
    "textcraft": "agentgym.envs.textcraft.compat",
    "sciworld": "agentgym.envs.sciworld.compat",
    "deepsearch": "agentgym.envs.deepsearch.compat",
    "webarena": "agentgym.envs.webarena.compat",
}


class CompatIds:
    """AgentGym's integer episode ids, mapped onto the manager's opaque ids."""

    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager
        self._next = itertools.count(0)
        self._episodes: dict[int, str] = {}

    def reserve(self) -> int:
        """The next number, before its episode exists (AgentGym's TextCraft resets to data_idx = id)."""
        return next(self._next)

    def bind(self, number: int, episode_id: str) -> int:
        self._episodes[number] = episode_id
        return number

    def add(self, episode_id: str) -> int:
        return self.bind(self.reserve(), episode_id)

    def episode_id(self, number: int) -> str:
        episode_id = self._episodes.get(number)
        if episode_id is None or self.manager._episodes.get(episode_id) is None:
            self._episodes.pop(number, None)
            raise EpisodeNotFoundError(str(number))
        return episode_id

    def remove(self, number: int) -> str:
        episode_id = self.episode_id(number)
        del self._episodes[number]
        return episode_id


def compat_error(status: int, message: str) -> JSONResponse:
    message = safe_text(message, 2_000)
    return JSONResponse({"error": message, "detail": message}, status_code=status)


class CompatErrorOut(BaseModel):
    """AgentGym's error payload: `error`, with the same message in `detail` for FastAPI-style clients."""

    error: str
    detail: Any


def compat_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` for the error statuses a compat route can answer (413 and 422: every body route)."""
    described = {
        404: "Unknown id or data index",
        409: "The episode cannot take this call now (no task yet, finished, failed, or closed meanwhile)",
        413: "Request body too large",
        429: "Live-episode cap reached, or the environment is out of capacity; retry later",
        500: "The environment crashed",
    }
    return {status: {"model": CompatErrorOut, "description": described[status]} for status in statuses}


_STATUS: list[tuple[type[Exception], int]] = [
    (EpisodeNotFoundError, 404),
    (UnknownTaskError, 404),
    (CapacityError, 429),
    (EpisodeStateError, 409),
    (EnvironmentCrashError, 500),
]


async def answer(call: Callable[[], Awaitable[T]]) -> T | JSONResponse:
    """Run a compat handler body, turning the manager's errors into AgentGym-style error payloads."""
    try:
        return await call()
    except HTTPException:
        raise
    except Exception as error:
        for kind, status in _STATUS:
            if isinstance(error, kind):
                return compat_error(status, str(error))
        raise


class StepBody(BaseModel):
    """AgentGym's `/step` body (integer episode id)."""

    id: BodyInt
    action: ActionText


class ResetBody(BaseModel):
    """AgentGym's `/reset` body: which task, by AgentGym's data index."""

    id: BodyInt
    data_idx: BodyIndex


class CloseBody(BaseModel):
    id: BodyInt


def add_common_routes(router: APIRouter, manager: EpisodeManager, ids: CompatIds, greeting: str) -> None:
    """The routes every AgentGym server has in the same shape: `GET /`, `GET /observation?id=`, `/close`."""

    @router.get("/", response_class=PlainTextResponse)
    async def hello() -> str:
        return greeting

    @router.get("/observation", responses=compat_errors(404))
    async def observation(id: int) -> Any:
        async def run() -> Any:
            return (await manager.observe(ids.episode_id(id))).observation

        return await answer(run)

    @router.post("/close", responses=compat_errors(404, 413))
    async def close(body: CloseBody) -> Any:
        async def run() -> Any:
            await manager.close(ids.remove(body.id))
            return {"closed": True}

        return await answer(run)


def compat_router(environment: str, manager: EpisodeManager) -> APIRouter | None:
    module_name = COMPAT_MODULES.get(environment)
    if module_name is None:
        return None
    module: Any = importlib.import_module(module_name)
    router: APIRouter = module.build_router(manager, CompatIds(manager))
    return router
