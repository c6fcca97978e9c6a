"""The in-process environment interface every environment kind implements.

An `Environment` is one episode's worth of state: `reset(task_id)` starts an episode of a task,
`step(action)` takes one bare action string (the agent side parses the model's output), and
`observe()` repeats the current observation. The service framework (`agentgym.envs.server`) hosts
many of these at once; users and tests can drive them directly through `agentgym.envs.make`.

Bad actions are data, not exceptions: an action that does not parse returns a `StepResult`
whose observation says what is valid and whose `info["invalid_action"]` is True.
Exceptions escaping `reset`/`step` mean the episode is broken; the service ends it as failed.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable


class UnknownTaskError(KeyError):
    """A task id (or split/index) that the environment's catalog does not contain."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown task"


class EnvironmentBusyError(RuntimeError):
    """The environment has no capacity for another episode right now (e.g. every JVM slot is leased).

    The service answers it like its own live-episode cap: 429 / RESOURCE_EXHAUSTED, retry later.
    """


class EpisodeNotStartedError(RuntimeError):
    """`step`/`observe` called before `reset`."""


@dataclass(frozen=True)
class ResetResult:
    observation: str
    available_actions: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """Outcome of one action.

    `reward` is the reward of this step; `score` is the episode's score so far in the
    environment's own units (BabyAI: minigrid's reward; TextCraft: 0/1; SciWorld: 0-100).
    `done` means the task ended (success or failure); `truncated` means the environment's own
    step limit cut it. `info` carries at least `invalid_action: bool` and `success: bool`.
    """

    observation: str
    reward: float
    done: bool
    truncated: bool = False
    score: float = 0.0
    available_actions: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


class TaskCatalog(abc.ABC):
    """The tasks of one environment kind, addressable by id or by (split, index).

    Task ids are stable strings; splits are deterministic (the same id is always in the same split).
    """

    @abc.abstractmethod
    def splits(self) -> dict[str, int]:
        """Split name -> number of tasks in it."""

    @abc.abstractmethod
    def task_id(self, split: str, index: int) -> str:
        """The id of the `index`-th task of `split`. Raises UnknownTaskError when out of range."""

    @abc.abstractmethod
    def describe(self, task_id: str) -> dict[str, Any]:
        """Metadata of a task (split, level/goal, difficulty, ...). Raises UnknownTaskError."""

    def task_ids(self, split: str, limit: int | None = None) -> Sequence[str]:
        count = self.splits().get(split)
        if count is None:
            raise UnknownTaskError(f"unknown split {split!r}; splits are {sorted(self.splits())}")
        n = count if limit is None else min(limit, count)
        return [self.task_id(split, i) for i in range(n)]

    def _check_split_index(self, split: str, index: int) -> None:
        splits = self.splits()
        if split not in splits:
            raise UnknownTaskError(f"unknown split {split!r}; splits are {sorted(splits)}")
        if not 0 <= index < splits[split]:
            raise UnknownTaskError(f"index {index} out of range for split {split!r} (0..{splits[split] - 1})")


class Environment(abc.ABC):
    """One live episode of an environment kind. Not thread-safe: one caller at a time."""

    name: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def catalog(cls) -> TaskCatalog:
        """The task catalog of this kind (cheap to call repeatedly; cache inside)."""

    @abc.abstractmethod
    def reset(self, task_id: str) -> ResetResult:
        """Start (or restart) an episode of `task_id`. Raises UnknownTaskError."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Take one bare action (e.g. ``turn left``)."""

    @abc.abstractmethod
    def observe(self) -> str:
        """The current observation, without acting."""

    def available_actions(self) -> list[str] | None:
        """Actions valid now, where the environment can list them; None otherwise."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most environments hold no resources
        """Release resources held by this episode."""


class Expert(Protocol):
    """A scripted solver: the bare actions that solve a task, for tests, demos and SFT data."""

    def demonstrate(self, task_id: str) -> list[str]: ...


@runtime_checkable
class ObservingExpert(Protocol):
    """An expert that reads the page as it goes (WebArena's solvers): besides `demonstrate`, which plays
    an episode of its own, it can choose each action inside an episode someone else runs, so that
    building SFT data plays each task once, not twice."""

    def demonstrate(self, task_id: str) -> list[str]: ...

    def next_action(self, task_id: str, first: ResetResult, observation: str, actions: Sequence[str]) -> str:
        """The action after `actions`, on `observation`; `first` is the episode's reset."""
        ...


@dataclass
class ExpertEpisode:
    """An observing expert's play of one task: what it saw and did."""

    first: ResetResult
    actions: list[str]
    observations: list[str]  # after each action
    success: bool


def play_expert(expert: ObservingExpert, env: Environment, task_id: str, max_actions: int = 20) -> ExpertEpisode:
    """Reset `env` to `task_id` and let `expert` act until the episode ends (or `max_actions`, for a solver
    that never finishes)."""
    first = env.reset(task_id)
    episode = ExpertEpisode(first, [], [], False)
    observation = first.observation
    for _ in range(max_actions):
        episode.actions.append(expert.next_action(task_id, first, observation, episode.actions))
        result = env.step(episode.actions[-1])
        observation = result.observation
        episode.observations.append(observation)
        if result.done or result.truncated:
            episode.success = bool(result.info.get("success", False))
            break
    return episode
