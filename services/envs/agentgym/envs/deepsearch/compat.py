"""AgentGym SearchQA routes (agentenv-searchqa's server), over the shared episode manager.

* ``POST /create {"id": data_idx}`` -> a bare int ``env_idx``; the episode is reset to the task at
  AgentGym data index ``data_idx`` (test tasks first, then train, then user datasets:
  `DeepSearchCatalog.compat_task_id`);
* ``POST /step {"env_idx", "action"}`` -> ``{"observation", "reward", "done", "info"}``; the action
  may be the whole model response (the first ``<search>``/``<answer>`` tag counts);
* ``GET /observation?env_idx=`` -> the question prompt (as AgentGym: it does not change with steps);
* ``POST /reset {"env_idx", "id"}`` -> the new question prompt (without ``id``: the same task again);
* ``POST /close {"env_idx"}`` -> ``true``;
* ``GET /`` -> ``"ok"``.

Unknown ``env_idx`` or data index -> 404, a step after the episode ended -> 409, each with
AgentGym's ``error`` field beside ``detail``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from agentgym.envs.base import Environment
from agentgym.envs.deepsearch.env import DeepSearchEnv
from agentgym.envs.deepsearch.tasks import DeepSearchCatalog
from agentgym.envs.server.compat import CompatIds, answer, compat_errors
from agentgym.envs.server.limits import ActionText, BodyInt
from agentgym.envs.server.manager import EpisodeManager


class CreateQuery(BaseModel):
    id: BodyInt = Field(default=0, description="AgentGym data index of the question")


class StepQuery(BaseModel):
    env_idx: BodyInt
    action: ActionText = Field(description="The model's reply; its first <search> or <answer> tag is the action")


class ResetQuery(BaseModel):
    env_idx: BodyInt
    id: BodyInt | None = None


class CloseQuery(BaseModel):
    env_idx: BodyInt


def _prompt(env: Environment) -> str:
    if isinstance(env, DeepSearchEnv):
        return env.prompt()
    return env.observe()  # a failed episode's stand-in explains the failure


def build_router(manager: EpisodeManager, ids: CompatIds) -> APIRouter:
    router = APIRouter(tags=["agentgym"])
    catalog = manager.catalog
    if not isinstance(catalog, DeepSearchCatalog):
        raise TypeError(f"the deepsearch compat routes need a DeepSearchCatalog, not {type(catalog).__name__}")

    @router.get("/", response_model=str)
    async def hello() -> str:
        return "ok"

    @router.post("/create", response_model=int, responses=compat_errors(404, 413, 429, 500))
    async def create(body: CreateQuery) -> int | JSONResponse:
        async def run() -> int:
            task_id = catalog.compat_task_id(body.id)
            episode, _ = await manager.open(task_id)
            return ids.add(episode.episode_id)

        return await answer(run)

    @router.post("/step", response_model=None, responses=compat_errors(404, 409, 413))
    async def step(body: StepQuery) -> dict[str, Any] | JSONResponse:
        async def run() -> dict[str, Any]:
            result = await manager.step(ids.episode_id(body.env_idx), body.action)
            return {
                "observation": result.observation,
                "reward": result.reward,
                "done": result.done or result.truncated,
                "info": result.info,
            }

        return await answer(run)

    @router.get("/observation", response_model=str, responses=compat_errors(404, 409))
    async def observation(env_idx: int) -> str | JSONResponse:
        async def run() -> str:
            return await manager.call(ids.episode_id(env_idx), _prompt)

        return await answer(run)

    @router.post("/reset", response_model=str, responses=compat_errors(404, 409, 413, 429, 500))
    async def reset(body: ResetQuery) -> str | JSONResponse:
        async def run() -> str:
            episode_id = ids.episode_id(body.env_idx)
            if body.id is None:
                task_id = manager.get(episode_id).task_id
                if task_id is None:  # never the case: /create always names a task
                    task_id = catalog.compat_task_id(0)
            else:
                task_id = catalog.compat_task_id(body.id)
            result = await manager.reset(episode_id, task_id)
            return result.observation

        return await answer(run)

    @router.post("/close", response_model=None, responses=compat_errors(404, 413))
    async def close(body: CloseQuery) -> bool | JSONResponse:
        async def run() -> bool:
            await manager.close(ids.remove(body.env_idx))
            return True

        return await answer(run)

    return router
