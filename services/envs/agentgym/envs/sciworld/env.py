"""SciWorld: one ScienceWorld episode, on a warm JVM leased from the process's slot pool.

On reset the agent sees the task description and the room (``look around``), as in AgentGym::

    Your task is to boil water. ... First, focus on the substance. ...
    This room is called the hallway. In it, you see: ...

Actions are ScienceWorld's free text (``open door to kitchen``, ``focus on water``, ``wait1``);
each step answers with ScienceWorld's own text. Text that ScienceWorld cannot parse answers
"No known action matches that input." with ``info["invalid_action"] = True`` (not an error).

Score and reward: `score` is ScienceWorld's score, 0-100; `reward` is its change this step;
``info["normalized_score"]`` is score / 100. ScienceWorld signals a failed task (e.g. focusing on
the wrong object) with a score of -100: the episode is then done, unsuccessful, its score is 0,
and ``info["task_failed"]`` is True with ``info["raw_score"] = -100``. `done` is ScienceWorld's
completion flag (or that failure); ``success`` means the score reached 100. With `step_limit` the
episode is truncated once ScienceWorld's move counter reaches it (the `scienceworld` wheel's
``envStepLimit``, 100 there and in AgentGym; off by default, the agent's horizon bounds episodes).

The step is ScienceWorld's raw step (the simulator's step, score, completion and move counter):
the wheel's `env.step()` also fetches look, inventory and task description, and the full list of
valid actions element by element over py4j, every step. Here valid actions are computed only when
asked: `available_actions()` (GET /v1/episodes/{id}/actions, AgentGym's /action_hint), or on every
step with ``valid_actions_in_step=True``.

Settings (``agentgym env serve sciworld --set KEY=VALUE``): ``pool_size`` (slots, i.e. simulators,
at most; default none: a slot for every live episode, which the service caps), ``warm_slots`` (slots
started up front; default all of a sized pool, else 8), ``simulators_per_jvm`` (slots
sharing one JVM, 8; 1 gives each its own JVM), ``heap_mb`` (heap cap per simulator, 768: a JVM of
n simulators is capped at n x heap_mb), ``lease_timeout_s`` (wait for a free slot, 60),
``step_limit``, ``valid_actions_in_step``, ``java``, ``java_options``, ``cds`` ("auto"/"off"/path),
``startup_timeout_s``, ``call_timeout_s``.

A JVM's slots share its fate: if it dies, every episode on it fails at its next call with the
JVM's exit reason (`SlotDiedError`), and the pool replaces the JVM and its slots.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

from agentgym.envs.base import Environment, EpisodeNotStartedError, ResetResult, StepResult
from agentgym.envs.sciworld.jvm import DEFAULT_HEAP_MB, JVMDiedError, JVMSettings
from agentgym.envs.sciworld.pool import DEFAULT_SIMULATORS_PER_JVM, PoolSettings, SciWorldPool, Slot, shared_pool
from agentgym.envs.sciworld.tasks import SciWorldCatalog, TaskInfo, load_catalog

INVALID_PREFIXES = ("No known action matches that input.", "Unknown action.")
AMBIGUOUS_PREFIX = "Ambiguous request"
EPISODE_OVER = "The episode is over; reset to start a new one."


class SlotDiedError(RuntimeError):
    """The JVM behind this episode died or hung; the episode cannot go on (the pool replaces the JVM).

    Every episode on that JVM's slots gets it at its next call, with the JVM's exit reason.
    """


def pool_settings(
    pool_size: int | None = None,
    warm_slots: int | None = None,
    simulators_per_jvm: int = DEFAULT_SIMULATORS_PER_JVM,
    heap_mb: int = DEFAULT_HEAP_MB,
    java: str | None = None,
    java_options: Sequence[str] | str = (),
    cds: str = "auto",
    startup_timeout_s: float = 120.0,
    call_timeout_s: float = 300.0,
) -> PoolSettings:
    """Pool settings from the environment's keyword settings (shared by env, expert and benchmark)."""
    options = tuple(java_options.split()) if isinstance(java_options, str) else tuple(java_options)
    jvm = JVMSettings(
        heap_mb=int(heap_mb),
        java=java,
        java_options=options,
        cds=str(cds),
        startup_timeout_s=float(startup_timeout_s),
        call_timeout_s=float(call_timeout_s),
    )
    return PoolSettings(
        size=None if pool_size is None else int(pool_size),
        warm_slots=None if warm_slots is None else int(warm_slots),
        simulators_per_jvm=int(simulators_per_jvm),
        jvm=jvm,
    )


class SciWorldEnv(Environment):
    """One SciWorld episode. Cheap to construct: the JVM is leased at the first reset."""

    name: ClassVar[str] = "sciworld"

    def __init__(
        self,
        *,
        lease_timeout_s: float = 60.0,
        step_limit: int | None = None,
        valid_actions_in_step: bool = False,
        pool: SciWorldPool | None = None,
        **pool_config: Any,
    ) -> None:
        if step_limit is not None and int(step_limit) < 1:
            raise ValueError(f"step_limit must be a positive number of moves or None, not {step_limit!r}")
        if lease_timeout_s <= 0:
            raise ValueError("lease_timeout_s must be positive")
        self.lease_timeout_s = float(lease_timeout_s)
        self.step_limit = None if step_limit is None else int(step_limit)
        self.valid_actions_in_step = bool(valid_actions_in_step)
        self._pool = pool if pool is not None else shared_pool(pool_settings(**pool_config))
        self._pool.start()  # warms JVMs in background threads; returns at once
        self._catalog = load_catalog()
        self._slot: Slot | None = None
        self._release: weakref.finalize[Any, Any] | None = None
        self._busy = threading.Lock()  # held during simulator calls; close() checks it
        self._task: TaskInfo | None = None
        self._task_description = ""
        self._observation = ""
        self._last_output = ""
        self._score = 0
        self._done = False
        self._truncated = False

    @classmethod
    def catalog(cls) -> SciWorldCatalog:
        return load_catalog()

    # -- episode ---------------------------------------------------------------------------------

    def reset(self, task_id: str) -> ResetResult:
        info = self._catalog.info(task_id)  # raises UnknownTaskError
        slot = self._lease()
        with self._busy:
            try:
                slot.sim.load(info.task_name, info.variation)
                description = slot.sim.task_description()
                look, _, _, _ = slot.sim.step("look around")
            except JVMDiedError as error:
                raise SlotDiedError(str(error)) from error
        self._task = info
        self._task_description = description
        self._last_output = look
        self._observation = f"{description}\n{look}"
        self._score = 0
        self._done = False
        self._truncated = False
        return ResetResult(
            observation=self._observation,
            available_actions=self._valid_actions() if self.valid_actions_in_step else None,
            info={
                "task_id": task_id,
                "task_name": info.task_name,
                "task_number": info.kind.number,
                "variation": info.variation,
                "split": info.split,
                "task_description": description,
                "look": look,
                "jvm_pid": slot.jvm.pid,
            },
        )

    def step(self, action: str) -> StepResult:
        slot = self._require_episode()
        if self._done or self._truncated:
            return StepResult(
                observation=EPISODE_OVER,
                reward=0.0,
                done=self._done,
                truncated=self._truncated,
                score=float(self._score),
                info={"invalid_action": False, "success": self._score >= 100, "episode_over": True},
            )
        text = (action if isinstance(action, str) else str(action)).strip()
        with self._busy:
            try:
                observation, raw, completed, moves = slot.sim.step(text)
            except JVMDiedError as error:
                raise SlotDiedError(str(error)) from error
        raw_score = round(100 * raw)
        task_failed = raw_score < 0
        score = max(raw_score, 0)
        reward = score - self._score
        self._score = score
        self._done = completed or task_failed
        self._truncated = not self._done and self.step_limit is not None and moves >= self.step_limit
        self._last_output = observation
        self._observation = observation
        return StepResult(
            observation=observation,
            reward=float(reward),
            done=self._done,
            truncated=self._truncated,
            score=float(score),
            available_actions=self._valid_actions() if self.valid_actions_in_step and not self._done else None,
            info={
                "invalid_action": observation.startswith(INVALID_PREFIXES),
                "ambiguous": observation.startswith(AMBIGUOUS_PREFIX),
                "success": score >= 100,
                "task_failed": task_failed,
                "raw_score": raw_score,
                "normalized_score": score / 100,
                "moves": moves,
            },
        )

    def observe(self) -> str:
        self._require_episode()
        return self._observation

    @property
    def last_output(self) -> str:
        """ScienceWorld's own last answer (after reset: the room, without the task description)."""
        self._require_episode()
        return self._last_output

    def available_actions(self) -> list[str] | None:
        self._require_episode()
        return self._valid_actions()

    def action_hint(self) -> dict[str, list[str]]:
        """AgentGym's hint: the action templates and the object names in view."""
        slot = self._require_episode()
        with self._busy:
            try:
                return {
                    "possible_actions": slot.sim.possible_actions(),
                    "possible_objects": slot.sim.possible_objects(),
                }
            except JVMDiedError as error:
                raise SlotDiedError(str(error)) from error

    def goal_progress(self) -> str:
        slot = self._require_episode()
        with self._busy:
            try:
                return slot.sim.goal_progress()
            except JVMDiedError as error:
                raise SlotDiedError(str(error)) from error

    @property
    def score(self) -> int:
        return self._score

    @property
    def jvm_pid(self) -> int | None:
        return None if self._slot is None else self._slot.jvm.pid

    def close(self) -> None:
        """Hand the JVM back to the pool; one still busy in a call (a timed-out step) is killed and replaced."""
        release, self._release = self._release, None
        slot, self._slot = self._slot, None
        self._task = None
        if release is None or slot is None:
            return
        release.detach()
        if self._busy.acquire(blocking=False):
            try:
                self._pool.release(slot, healthy=slot.alive())
            finally:
                self._busy.release()
        else:
            self._pool.release(slot, healthy=False)

    # -- internals -------------------------------------------------------------------------------

    def _lease(self) -> Slot:
        if self._slot is not None:
            if self._slot.alive():
                return self._slot
            self.close()  # its JVM died between episodes: hand it back for replacement, take another
        slot = self._pool.lease(self.lease_timeout_s)
        self._slot = slot
        self._release = weakref.finalize(self, self._pool.release, slot, True)  # if never closed
        return slot

    def _require_episode(self) -> Slot:
        if self._task is None or self._slot is None:
            raise EpisodeNotStartedError("reset the SciWorld environment to a task first")
        return self._slot

    def _valid_actions(self) -> list[str]:
        slot = self._require_episode()
        with self._busy:
            try:
                return slot.sim.valid_actions()
            except JVMDiedError as error:
                raise SlotDiedError(str(error)) from error
