"""AgentGym's WebArena routes (agentenv-webarena), on the shared episode manager.

* ``POST /create`` -> ``{"env_idx": 0}``: an episode without a task (no browser context yet);
* ``POST /reset {"env_idx", "seed", "idx"}`` -> ``{observation, sites, object}``: `idx` indexes the
  ``webarena`` split when WebArena task configs are loaded, MiniWoB++'s ``test`` split otherwise;
  `object` is the task's objective, `sites` the sites it may visit. `seed` is accepted for
  AgentGym's clients and not used: a task id already fixes its problem (MiniWoB's seed is in it);
* ``POST /step {"env_idx", "action"}`` -> ``{observation, reward, terminated, truncated, info}``: like
  AgentGym's server, which is sent the model's whole reply (``Let's think step-by-step. ... In summary,
  the next action I will perform is ```click [23]``` ``), the action is the first ```-fenced span of
  `action` (`extract_action`); a reply without one is taken whole, so a bare action works too;
* ``GET /observation?env_idx=`` -> the current observation;
* ``POST /close {"env_idx"}``.

Errors carry AgentGym's ``error`` beside ``detail``, with proper HTTP statuses (unknown id 404,
finished episode 409, cap 429, crashed browser 500).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from agentgym.envs.base import UnknownTaskError
from agentgym.envs.server.compat import CompatIds, answer, compat_errors
from agentgym.envs.server.limits import ActionText, BodyIndex, BodyInt
from agentgym.envs.server.manager import EpisodeManager

# AgentGym's WebArena server reads the action as `re.search(r"```((.|\n)*?)```", reply)`: the first
# fenced span, stripped (its prompt's action_splitter is ```). DOTALL and `.*?` match the same spans.
_FENCED = re.compile(r"```(.*?)```", re.DOTALL)


def extract_action(reply: str) -> str:
    """The action in a model's reply, as AgentGym's WebArena server reads it: the first ```-fenced span,
    stripped. A reply without one is taken whole (a bare action; the environment says if it does not parse).
    """
    match = _FENCED.search(reply)
    return match.group(1).strip() if match else reply


class EnvBody(BaseModel):
    env_idx: BodyInt


class ResetBody(BaseModel):
    env_idx: BodyInt
    seed: BodyInt = 0
    idx: BodyIndex = 0


class StepBody(BaseModel):
    env_idx: BodyInt
    action: ActionText = Field(description="The model's reply (or a bare action); the first ```-fenced span is used")


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

    @router.post("/create", responses=compat_errors(429, 500))
    async def create() -> Any:
        async def run() -> Any:
            episode, _ = await manager.open()
            return {"env_idx": ids.add(episode.episode_id)}

        return await answer(run)

    @router.post("/reset", responses=compat_errors(404, 409, 413, 429, 500))
    async def reset(body: ResetBody) -> Any:
        async def run() -> Any:
            task_id, sites = task_for(body.idx)
            first = await manager.reset(ids.episode_id(body.env_idx), task_id)
            return {"observation": first.observation, "sites": sites, "object": first.info.get("objective", "")}

        return await answer(run)

    @router.post("/step", responses=compat_errors(404, 409, 413))
    async def step(body: StepBody) -> Any:
        async def run() -> Any:
            result = await manager.step(ids.episode_id(body.env_idx), extract_action(body.action))
            return {
                "observation": result.observation,
                "reward": result.reward,
                "terminated": result.done,
                "truncated": result.truncated,
                "info": result.info,
            }

        return await answer(run)

    @router.get("/observation", responses=compat_errors(404))
    async def observation(env_idx: int) -> Any:
        async def run() -> Any:
            return (await manager.observe(ids.episode_id(env_idx))).observation

        return await answer(run)

    @router.post("/close", responses=compat_errors(404, 413))
    async def close(body: EnvBody) -> Any:
        async def run() -> Any:
            await manager.close(ids.remove(body.env_idx))
            return {"closed": True}

        return await answer(run)

    return router
