"""AgentGym's BabyAI routes, unchanged for its clients.

`/create` opens an episode without a task (AgentGym's BabyAI resets separately); `/reset {id,
data_idx}` picks the task: like AgentGym, level ``data_idx % 40`` with the ``data_idx // 40``-th
seed, i.e. index ``data_idx`` of the test split, continuing into the train split past its end.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from agentgym.envs.base import UnknownTaskError
from agentgym.envs.server.compat import CompatIds, ResetBody, StepBody, add_common_routes, answer, compat_errors
from agentgym.envs.server.manager import EpisodeManager


def build_router(manager: EpisodeManager, ids: CompatIds) -> APIRouter:
    router = APIRouter(tags=["agentgym-compat"])
    splits = manager.catalog.splits()

    def data_task(data_idx: int) -> str:
        if data_idx < splits["test"]:
            return manager.catalog.task_id("test", data_idx)
        if data_idx - splits["test"] < splits["train"]:
            return manager.catalog.task_id("train", data_idx - splits["test"])
        raise UnknownTaskError(f"data_idx {data_idx} out of range (0..{splits['test'] + splits['train'] - 1})")

    add_common_routes(router, manager, ids, "This is environment BabyAI.")

    @router.post("/create", responses=compat_errors(429, 500))
    async def create() -> Any:
        async def run() -> Any:
            episode, _ = await manager.open(None)
            return {"id": ids.add(episode.episode_id)}

        return await answer(run)

    @router.post("/reset", responses=compat_errors(404, 409, 413, 429, 500))
    async def reset(body: ResetBody) -> Any:
        async def run() -> Any:
            first = await manager.reset(ids.episode_id(body.id), data_task(body.data_idx))
            return {"observation": first.observation, "reward": 0.0, "score": 0.0, "deleted": False, "done": False}

        return await answer(run)

    @router.post("/step", responses=compat_errors(404, 409, 413))
    async def step(body: StepBody) -> Any:
        async def run() -> Any:
            result = await manager.step(ids.episode_id(body.id), body.action)
            return {
                "observation": result.observation,
                "reward": result.reward,
                "score": result.score,
                "done": result.done or result.truncated,
            }

        return await answer(run)

    return router
