"""AgentGym's WebArena routes (agentenv-webarena), on the shared episode manager.

* ``POST /create`` -> ``{"env_idx": 0}``: an episode without a task (no browser context yet);
* ``POST /reset {"env_idx", "seed", "idx"}`` -> ``{observation, sites, object}``: `idx` indexes the
  ``webarena`` split when WebArena task configs are loaded, MiniWoB++'s ``test`` split otherwise;
  `object` is the task's objective, `sites` the sites it may visit. `seed` is accepted for
  AgentGym's clients and not used: a task id already fixes its problem (MiniWoB's seed is in it);
* ``POST /step {"env_idx", "action"}`` -> ``{observation, reward, terminated, truncated, info}``;
* ``GET /observation?env_idx=`` -> the current observation;
* ``POST /close {"env_idx"}``.

Errors carry AgentGym's ``error`` beside ``detail``, with proper HTTP statuses (unknown id 404,
finished episode 409, cap 429, crashed browser 500).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from agentgym.envs.base import UnknownTaskError
from agentgym.envs.server.compat import CompatIds, answer
from agentgym.envs.server.manager import EpisodeManager


class EnvBody(BaseModel):
    env_idx: int


class ResetBody(BaseModel):
    env_idx: int
    seed: int = 0
    idx: int = Field(default=0, ge=0)


class StepBody(BaseModel):
    env_idx: int
    action: str = Field(max_length=16_384)


def build_router(manager: EpisodeManager, ids: CompatIds) -> APIRouter:
    router = APIRouter(tags=["agentgym-compat"])

    def task_for(idx: int) -> tuple[str, list[str]]:
        splits = manager.catalog.splits()
        split = "webarena" if "webarena" in splits else "test"
        if not 0 <= idx < splits[split]:
            raise UnknownTaskError(f"idx {idx} out of range for split {split!r} (0..{splits[split] - 1})")
        task_id = manager.catalog.task_id(split, idx)
        described = manager.catalog.describe(task_id)
        sites = list(described.get("sites", ())) or ["miniwob"]
        return task_id, sites

    @router.get("/", response_class=PlainTextResponse)
    async def hello() -> str:
        return "This is environment WebArena."

    @router.post("/create")
    async def create() -> Any:
        async def run() -> Any:
            episode, _ = await manager.open()
            return {"env_idx": ids.add(episode.episode_id)}

        return await answer(run)

    @router.post("/reset")
    async def reset(body: ResetBody) -> Any:
        async def run() -> Any:
            task_id, sites = task_for(body.idx)
            first = await manager.reset(ids.episode_id(body.env_idx), task_id)
            return {"observation": first.observation, "sites": sites, "object": first.info.get("objective", "")}

        return await answer(run)

    @router.post("/step")
    async def step(body: StepBody) -> Any:
        async def run() -> Any:
            result = await manager.step(ids.episode_id(body.env_idx), body.action)
            return {
                "observation": result.observation,
                "reward": result.reward,
                "terminated": result.done,
                "truncated": result.truncated,
                "info": result.info,
            }

        return await answer(run)

    @router.get("/observation")
    async def observation(env_idx: int) -> Any:
        async def run() -> Any:
            return (await manager.observe(ids.episode_id(env_idx))).observation

        return await answer(run)

    @router.post("/close")
    async def close(body: EnvBody) -> Any:
        async def run() -> Any:
            await manager.close(ids.remove(body.env_idx))
            return {"closed": True}

        return await answer(run)

    return router
