"""AgentGym's SciWorld routes (agentenv-sciworld), on the shared episode manager.

* ``POST /create`` -> ``{"id": 0}``: an episode without a task (no JVM is held until its reset);
* ``POST /reset {"id", "data_idx"}`` -> ``{task_name, var_num, task_description, observation,
  reward, score, deleted, done}``: `data_idx` indexes AgentGym's task list (every variation of the
  23 tasks AgentGym keeps, in ScienceWorld's task order: the catalog's ``all`` split); the
  observation is the room (``look around``), the client prepends the task description itself;
* ``POST /step {"id", "action"}`` -> ``{observation, reward, score, done}``;
* ``GET /observation?id=`` -> ScienceWorld's last answer (a JSON string);
* ``GET /action_hint?id=`` -> ``{possible_actions, possible_objects}``;
* ``GET /goals?id=`` -> ``{goals}`` (ScienceWorld's goal progress);
* ``POST /close {"id"}`` -> ``{"id", "closed": true}``.

Scores follow the native API: 0-100, a failed task scores 0 (ScienceWorld reports -100) and is
done. Errors carry AgentGym's ``error`` beside ``detail``, with proper HTTP statuses (unknown id 404,
finished episode 409, cap 429, crashed environment 500).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from agentgym.envs.base import Environment
from agentgym.envs.sciworld.env import SciWorldEnv
from agentgym.envs.sciworld.tasks import load_catalog
from agentgym.envs.server.compat import CompatIds, answer, compat_errors
from agentgym.envs.server.limits import ActionText, BodyInt
from agentgym.envs.server.manager import EnvironmentCrashError, Episode, EpisodeManager, EpisodeStateError


class IdBody(BaseModel):
    id: BodyInt


class StepBody(BaseModel):
    id: BodyInt
    action: ActionText


class ResetBody(BaseModel):
    id: BodyInt
    data_idx: BodyInt = 0


def _ready(episode: Episode) -> SciWorldEnv:
    """The episode's environment, when it has a task and has not failed."""
    if episode.task_id is None:
        raise EpisodeStateError(f"episode {episode.episode_id!r} has no task yet; reset it first")
    if episode.status == "failed" or not isinstance(episode.env, SciWorldEnv):
        raise EpisodeStateError(f"episode {episode.episode_id!r} failed: {episode.failure}")
    return episode.env


def build_router(manager: EpisodeManager, ids: CompatIds) -> APIRouter:
    router = APIRouter(tags=["agentgym"])
    catalog = load_catalog()

    @router.get("/", response_class=PlainTextResponse)
    async def hello() -> str:
        return "This is environment ScienceWorld."

    @router.post("/create", responses=compat_errors(429, 500))
    async def create() -> Any:
        async def body() -> dict[str, Any]:
            episode, _ = await manager.open()
            return {"id": ids.add(episode.episode_id)}

        return await answer(body)

    @router.post("/reset", responses=compat_errors(404, 409, 413, 429, 500))
    async def reset(request: ResetBody) -> Any:
        async def body() -> dict[str, Any]:
            episode_id = ids.episode_id(request.id)
            task_id = catalog.from_agentgym(request.data_idx)
            result = await manager.reset(episode_id, task_id)
            return {
                "task_name": result.info["task_name"],
                "var_num": result.info["variation"],
                "task_description": result.info["task_description"],
                "observation": result.info["look"],
                "reward": 0,
                "score": 0,
                "deleted": False,
                "done": False,
            }

        return await answer(body)

    @router.post("/step", responses=compat_errors(404, 409, 413))
    async def step(request: StepBody) -> Any:
        async def body() -> dict[str, Any]:
            result = await manager.step(ids.episode_id(request.id), request.action)
            return {
                "observation": result.observation,
                "reward": result.reward,
                "score": result.score,
                "done": result.done or result.truncated,
            }

        return await answer(body)

    @router.get("/observation", responses=compat_errors(404, 409))
    async def observation(id: int) -> Any:
        async def body() -> str:
            episode = await manager.observe(ids.episode_id(id))
            if episode.task_id is not None and episode.status == "failed":
                return episode.observation
            return _ready(episode).last_output

        return await answer(body)

    async def _call(number: int, fn: str) -> Any:
        episode = manager.get(ids.episode_id(number))
        _ready(episode)

        def run(env: Environment) -> Any:
            return getattr(_ready_env(env), fn)()

        try:
            return await manager.call(episode.episode_id, run)
        except (EpisodeStateError, LookupError):
            raise
        except Exception as error:
            raise EnvironmentCrashError(f"{fn} failed: {type(error).__name__}: {error}") from error

    @router.get("/action_hint", responses=compat_errors(404, 409, 500))
    async def action_hint(id: int) -> Any:
        return await answer(lambda: _call(id, "action_hint"))

    @router.get("/goals", responses=compat_errors(404, 409, 500))
    async def goals(id: int) -> Any:
        async def body() -> dict[str, str]:
            return {"goals": await _call(id, "goal_progress")}

        return await answer(body)

    @router.post("/close", responses=compat_errors(404, 413))
    async def close(request: IdBody) -> Any:
        async def body() -> dict[str, Any]:
            episode_id = ids.remove(request.id)
            await manager.close(episode_id)
            return {"id": request.id, "closed": True}

        return await answer(body)

    return router


def _ready_env(env: Environment) -> SciWorldEnv:
    if not isinstance(env, SciWorldEnv):
        raise EpisodeStateError("the episode's environment failed")
    return env
