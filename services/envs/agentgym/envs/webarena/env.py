"""WebArena: web navigation in a real Chromium, on MiniWoB++ tasks (offline) or WebArena's sites.

One `WebArenaEnv` is one episode at a time in its own browser context; all episodes of a service
process share one Chromium (`browser.shared_host`). The observation follows WebArena's prompt::

    Tab 0 (current): Click Button Task

    [1] RootWebArea 'Click Button Task' focused: True
        [14] button 'Okay'
    URL: http://127.0.0.1:41234/miniwob/click-button.html
    OBJECTIVE: Click on the "Okay" button.
    PREVIOUS ACTION: None

Actions follow WebArena's grammar (`actions.GRAMMAR`). An action that does not parse, or names an
id that is not on the page, answers with an observation saying so (``info["invalid_action"]``).

Tasks:

* ``miniwob/<task>/<seed>`` (splits ``train``/``test``): graded by the task page's own script.
  Reward 1 solved, 0 otherwise (partial credit where the task gives it); done when the task ends,
  or on ``stop``.
* ``webarena/<task_id>`` (split ``webarena``, when ``tasks_path`` names WebArena configs, e.g. its
  ``test.raw.json``; site URLs from ``WA_SHOPPING`` ...): the episode opens the task's start URLs
  (logged in where the config asks for it), may visit only the task's sites, and ends with
  ``stop [answer]``, graded by the task's evaluators (string/URL/program-HTML match; fuzzy match
  through ``judge_url``, an OpenAI-compatible completions endpoint, or reported unsupported).

Settings (``agentgym env serve webarena --set KEY=VALUE``): ``tasks_path``, ``judge_url``,
``judge_model``, ``max_pages`` (tabs per episode, 8), ``action_timeout_s`` (10),
``max_observation_chars`` (16000), ``chromium`` (binary, default /usr/bin/chromium),
``login_cache_dir``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from agentgym.envs.base import (
    Environment,
    EpisodeNotStartedError,
    ResetResult,
    StepResult,
    TaskCatalog,
    UnknownTaskError,
    play_expert,
)
from agentgym.envs.webarena.actions import ActionParseError, BrowserAction, parse_action
from agentgym.envs.webarena.browser import BrowserCrashedError, BrowserHost, BrowserSettings, shared_host
from agentgym.envs.webarena.miniwob import (
    CURATED_TASKS,
    SEEDS_PER_TASK,
    SOLVERS,
    SPLIT_VIEWS,
    START_JS,
    STATE_JS,
    MiniWoBTask,
    Solver,
    parse_task_id,
    shared_task_server,
    split_of,
    task_for,
)
from agentgym.envs.webarena.session import ActionError, BrowserSession, NoOpenTabError, PageView, SessionLimits

EPISODE_OVER = "The episode is over; reset to start a new one."
# Host-side margin over Playwright's own timeouts, so a hung browser is reported, not waited on.
_CALL_MARGIN_S = 15.0
# How long a failed call waits for the browser's disconnect before it is taken as the page's own error.
_CRASH_GRACE_S = 1.0


class WebArenaCatalog(TaskCatalog):
    """MiniWoB++ tasks (``train``/``test``, and views such as ``test-solvable``), plus WebArena tasks (``webarena``)
    when configured."""

    def __init__(self, webarena_ids: tuple[int, ...] = ()) -> None:
        self.webarena_ids = webarena_ids

    def splits(self) -> dict[str, int]:
        splits = {split: len(CURATED_TASKS) * count for split, count in SEEDS_PER_TASK.items()}
        for view, names in SPLIT_VIEWS.items():
            splits |= {f"{split}-{view}": len(names) * count for split, count in SEEDS_PER_TASK.items()}
        if self.webarena_ids:
            splits["webarena"] = len(self.webarena_ids)
        return splits

    def task_id(self, split: str, index: int) -> str:
        self._check_split_index(split, index)
        if split == "webarena":
            return f"webarena/{self.webarena_ids[index]}"
        return task_for(split, index).task_id

    def describe(self, task_id: str) -> dict[str, Any]:
        if task_id.startswith("webarena/"):
            number = task_id.removeprefix("webarena/")
            if not number.isdigit() or int(number) not in self.webarena_ids:
                raise UnknownTaskError(f"unknown WebArena task {task_id!r} (none loaded with that id)")
            return {"split": "webarena", "source": "webarena", "task_id": int(number)}
        task = parse_task_id(task_id)
        if task.seed >= SEED_OFFSET_LIMIT:
            raise UnknownTaskError(f"seed {task.seed} is out of range")
        return {
            "split": split_of(task),
            "source": "miniwob",
            "task": task.name,
            "seed": task.seed,
            "scripted_solver": task.name in SOLVERS,
        }


SEED_OFFSET_LIMIT = 2_000_000


class WebArenaEnv(Environment):
    """One browser episode. Cheap to construct: the browser context opens at the first reset."""

    name: ClassVar[str] = "webarena"

    def __init__(
        self,
        *,
        tasks_path: str | None = None,
        judge_url: str | None = None,
        judge_model: str | None = None,
        max_pages: int = 8,
        action_timeout_s: float = 10.0,
        max_observation_chars: int = 16_000,
        chromium: str = "",
        login_cache_dir: str | None = None,
        host: BrowserHost | None = None,
    ) -> None:
        self.limits = SessionLimits(
            max_pages=int(max_pages),
            action_timeout_s=float(action_timeout_s),
            max_observation_chars=int(max_observation_chars),
        )
        if self.limits.max_pages < 1:
            raise ValueError("max_pages must be at least 1")
        self._host = host or shared_host(BrowserSettings(executable_path=chromium))
        self.tasks_path = tasks_path or os.environ.get("WA_TASKS") or None
        self.judge_url = judge_url
        self.judge_model = judge_model
        self.login_cache_dir = Path(login_cache_dir) if login_cache_dir else None
        if self.tasks_path:
            register_webarena_tasks(self.tasks_path)
        self._catalog = self.catalog()
        self._session: BrowserSession | None = None
        self._task_id: str | None = None
        self._objective = ""
        self._previous_action = "None"
        self._observation = ""
        self._done = False
        self._score = 0.0

    @classmethod
    def catalog(cls) -> WebArenaCatalog:
        return WebArenaCatalog(tuple(sorted(_WEBARENA_TASKS)))

    # -- the sync interface (the service calls these from worker threads) -------------------------

    def _call(self, fn: Any) -> Any:
        timeout = self.limits.navigation_timeout_s + self.limits.action_timeout_s + _CALL_MARGIN_S
        try:
            return self._host.call(fn, timeout)
        except BrowserCrashedError:
            raise
        except Exception as error:
            # An ordinary ActionError (unknown id, hidden element) is the agent's; vanished tabs or a
            # failed browser call may be a crash Playwright has not reported yet: wait for it briefly.
            session = self._session
            suspect = isinstance(error, NoOpenTabError) or not isinstance(error, ActionError)
            if session is not None and suspect and self._crashed(session.generation):
                raise BrowserCrashedError(
                    f"the browser crashed during this episode ({error.__class__.__name__})"
                ) from error
            raise

    def _crashed(self, generation: int) -> bool:
        try:
            return bool(self._host.call(lambda: self._host.went_away(generation, _CRASH_GRACE_S), _CALL_MARGIN_S))
        except Exception:  # the host itself is unusable: the episode cannot go on either way
            return True

    def reset(self, task_id: str) -> ResetResult:
        self._catalog.describe(task_id)
        view, info = self._call(lambda: self._reset(task_id))
        self._task_id = task_id
        self._previous_action = "None"
        self._done = False
        self._score = 0.0
        self._observation = self._render(view)
        return ResetResult(observation=self._observation, info=info)

    def step(self, action: str) -> StepResult:
        if self._session is None or self._task_id is None:
            raise EpisodeNotStartedError("reset the environment before stepping")
        if self._done:
            return StepResult(EPISODE_OVER, 0.0, True, score=self._score, info={"invalid_action": True})
        try:
            parsed = parse_action(action)
        except ActionParseError as error:
            return self._invalid(str(error))
        try:
            view, reward, done, info = self._call(lambda: self._step(parsed))
        except ActionError as error:
            return self._invalid(f"Cannot do {action.strip()!r}: {error}.")
        self._previous_action = str(parsed)
        self._done = done
        self._score = max(self._score, reward) if done else self._score
        self._observation = self._render(view)
        info.setdefault("invalid_action", False)
        info.setdefault("success", done and reward >= 1.0)
        return StepResult(self._observation, reward, done, score=self._score, info=info)

    def observe(self) -> str:
        if self._session is None:
            raise EpisodeNotStartedError("reset the environment first")
        return self._observation

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                self._host.call(session.close, 10)

    def _invalid(self, message: str) -> StepResult:
        observation = f"{message}\n\n{self._observation}"
        return StepResult(observation, 0.0, False, score=self._score, info={"invalid_action": True, "success": False})

    def _render(self, view: PageView) -> str:
        lines = [*view.notes, view.render(self.limits.max_observation_chars)]
        lines += [f"URL: {view.url}", f"OBJECTIVE: {self._objective}", f"PREVIOUS ACTION: {self._previous_action}"]
        return "\n".join(line for line in lines)

    # -- on the browser loop -------------------------------------------------------------------------

    async def _fresh_session(self, origins: set[str], storage_state: str | None = None) -> BrowserSession:
        if self._session is not None:
            old, self._session = self._session, None
            await old.close()
        self._session = await BrowserSession.open(self._host, origins, self.limits, storage_state)
        return self._session

    async def _reset(self, task_id: str) -> tuple[PageView, dict[str, Any]]:
        if task_id.startswith("webarena/"):
            return await self._reset_webarena(int(task_id.removeprefix("webarena/")))
        task = parse_task_id(task_id)
        server = shared_task_server()
        session = await self._fresh_session({server.origin})
        await session.goto(server.url(task))
        page = session.page()
        await page.evaluate(START_JS, [str(task.seed)])
        await session.settle(page)
        state = await page.evaluate(STATE_JS)
        self._objective = str(state["utterance"])
        self._miniwob = task
        return await session.view(), {"task": task.name, "seed": task.seed, "objective": self._objective}

    async def _step(self, action: BrowserAction) -> tuple[PageView, float, bool, dict[str, Any]]:
        session = self._session
        assert session is not None and self._task_id is not None
        await session.execute(action)
        if self._task_id.startswith("webarena/"):
            return await self._step_webarena(session, action)
        state: dict[str, Any] = {"done": False, "raw_reward": 0.0, "reason": None}
        with contextlib.suppress(Exception):  # the task page may have navigated away
            state = await session.page().evaluate(STATE_JS)
        raw = float(state.get("raw_reward") or 0.0)
        done = bool(state.get("done")) or action.kind == "stop"
        reward = max(raw, 0.0) if state.get("done") else 0.0
        info = {"raw_reward": raw, "reason": state.get("reason"), "success": bool(state.get("done")) and raw >= 1.0}
        return await session.view(), reward, done, info

    # -- WebArena tasks ------------------------------------------------------------------------------

    async def _reset_webarena(self, number: int) -> tuple[PageView, dict[str, Any]]:
        from agentgym.envs.webarena import configs, login

        task = _WEBARENA_TASKS[number]
        site_urls = configs.SiteUrls.from_env()
        origins = set(configs.allowed_origins(task, site_urls))
        storage_state: str | None = None
        if task.require_login and task.login_sites:
            cache = self.login_cache_dir or Path(os.environ.get("WA_LOGIN_CACHE", ".webarena-auth"))
            browser, _ = await self._host.browser()
            storage_state = str(await login.storage_state_for(browser, task.login_sites, site_urls, cache))
        session = await self._fresh_session(origins, storage_state)
        for index, url in enumerate(task.start_urls):
            if index > 0:
                session.active = await session.context.new_page()
            await session.goto(url)
        if task.start_urls:
            session.active = session.pages()[0]
        await session.settle()
        self._objective = task.intent
        return await session.view(), {"task_id": number, "sites": list(task.sites), "objective": task.intent}

    async def _step_webarena(
        self, session: BrowserSession, action: BrowserAction
    ) -> tuple[PageView, float, bool, dict[str, Any]]:
        if action.kind != "stop":
            return await session.view(), 0.0, False, {}
        from agentgym.envs.webarena import configs, evaluators

        assert self._task_id is not None
        task = _WEBARENA_TASKS[int(self._task_id.removeprefix("webarena/"))]
        judge = evaluators.InferenceFuzzyJudge(self.judge_url, model=self.judge_model) if self.judge_url else None
        info: dict[str, Any] = {"answer": action.answer}
        try:
            result = await evaluators.evaluate(
                task, answer=action.answer, page=session.page(), judge=judge, site_urls=configs.SiteUrls.from_env()
            )
            reward = float(result.score)
            info["evaluation"] = result.details
        except evaluators.EvaluationError as error:
            # Not graded (unsupported check, judge or site unreachable): 0, and the reason is reported.
            reward = 0.0
            info["evaluation_error"] = f"{error.__class__.__name__}: {error}"
        return await session.view(), reward, True, info


# WebArena tasks loaded in this process (by `tasks_path`), by WebArena task id.
_WEBARENA_TASKS: dict[int, Any] = {}
_LOADED_PATHS: set[str] = set()


def register_webarena_tasks(path: str) -> int:
    """Load WebArena task configs (``test.raw.json`` or a folder of ``N.json``) into the catalog."""
    from agentgym.envs.webarena import configs

    resolved = str(Path(path).resolve())
    if resolved not in _LOADED_PATHS:
        for task in configs.load_task_configs(path, configs.SiteUrls.from_env()):
            _WEBARENA_TASKS[task.task_id] = task
        _LOADED_PATHS.add(resolved)
    return len(_WEBARENA_TASKS)


class WebArenaExpert:
    """Scripted MiniWoB++ solvers (`miniwob.SOLVERS`), run on an in-process episode.

    `demonstrate` plays the task and returns the actions taken. Element ids are numbered per episode, so
    another episode of the same task and seed gives the same ids to the same elements (`axtree.ElementIds`).
    """

    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    def solvable(self, task_id: str) -> bool:
        return task_id.startswith("miniwob/") and parse_task_id(task_id).name in SOLVERS

    def demonstrate(self, task_id: str) -> list[str]:
        _solver_for(task_id)  # an unsolved task fails before a browser is started
        env = WebArenaEnv(**self.settings)
        try:
            return play_expert(self, env, task_id).actions
        finally:
            env.close()

    def next_action(self, task_id: str, first: ResetResult, observation: str, actions: Sequence[str]) -> str:
        return _solver_for(task_id)(str(first.info["objective"]), observation, list(actions))


def _solver_for(task_id: str) -> Solver:
    task: MiniWoBTask = parse_task_id(task_id)
    solver = SOLVERS.get(task.name)
    if solver is None:
        raise UnknownTaskError(f"no scripted solver for {task.name!r}; solvers: {', '.join(sorted(SOLVERS))}")
    return solver


def run_solver(
    solver: Solver,
    objective: str,
    step: Callable[[str], tuple[str, float, bool]],
    observation: str,
    max_steps: int = 20,
) -> tuple[float, list[str]]:
    """Drive `solver` through any `step(action) -> (observation, reward, done)` API."""
    actions: list[str] = []
    reward = 0.0
    for _ in range(max_steps):
        action = solver(objective, observation, actions)
        actions.append(action)
        observation, reward, done = step(action)
        if done:
            break
    return reward, actions
