"""AgentGym's TextCraft routes, unchanged for its clients.

`/create` opens an episode and, like AgentGym, resets it to goal `data_idx = id` (modulo the 544
goals); `/reset {id, data_idx}` picks goal `data_idx` of the "all" split (AgentGym's order: by
depth). Steps answer `{observation, reward, done}`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from agentgym.envs.base import UnknownTaskError
from agentgym.envs.server.compat import CompatIds, ResetBody, StepBody, add_common_routes, answer, compat_errors
from agentgym.envs.server.limits import ActionText, NameText
from agentgym.envs.server.manager import EpisodeManager


class CreateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    commands: ActionText | None = Field(default=None, description="Not supported: must be null")
    goal: NameText | None = Field(default=None, description="Not supported: must be null")


def build_router(manager: EpisodeManager, ids: CompatIds) -> APIRouter:
    router = APIRouter(tags=["agentgym-compat"])
    goals = manager.catalog.splits()["all"]

    def goal_task(data_idx: int) -> str:
        if not 0 <= data_idx < goals:
            raise UnknownTaskError(f"data_idx {data_idx} out of range (0..{goals - 1})")
        return manager.catalog.task_id("all", data_idx)

    add_common_routes(router, manager, ids, "This is environment TextCraft.")

    @router.post("/create", responses=compat_errors(404, 413, 429, 500))
    async def create(body: CreateBody | None = None) -> Any:
        async def run() -> Any:
            if body is not None and (body.commands or body.goal):
                raise UnknownTaskError("custom commands/goal are not supported; use /reset with a data_idx")
            number = ids.reserve()
            episode, first = await manager.open(goal_task(number % goals))
            ids.bind(number, episode.episode_id)
            assert first is not None
            return {"id": number, "observation": first.observation, "done": False, "reward": 0}

        return await answer(run)

    @router.post("/step", responses=compat_errors(404, 409, 413))
    async def step(body: StepBody) -> Any:
        async def run() -> Any:
            result = await manager.step(ids.episode_id(body.id), body.action)
            return {"observation": result.observation, "reward": result.reward, "done": result.done}

        return await answer(run)

    @router.post("/reset", responses=compat_errors(404, 409, 413, 429, 500))
    async def reset(body: ResetBody) -> Any:
        async def run() -> Any:
            first = await manager.reset(ids.episode_id(body.id), goal_task(body.data_idx))
            return {"id": body.id, "observation": first.observation, "done": False, "reward": 0}

        return await answer(run)

    return router
