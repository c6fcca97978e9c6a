"""A small environment for exercising the service framework's contract, including failures on demand.

In its own module (not conftest.py) so `from countdown_env import ...` is unambiguous across test folders.
"""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

from agentgym.envs.base import Environment, ResetResult, StepResult, TaskCatalog, UnknownTaskError
from agentgym.envs.server.manager import EpisodeManager, ManagerConfig


class CountdownCatalog(TaskCatalog):
    """Task `count/N`: say "tick" N times. Splits: train (N=1..20), test (N=1..5)."""

    SIZES: ClassVar[dict[str, int]] = {"train": 20, "test": 5}

    def splits(self) -> dict[str, int]:
        return dict(self.SIZES)

    def task_id(self, split: str, index: int) -> str:
        self._check_split_index(split, index)
        return f"count/{index + 1}" if split == "train" else f"count/{100 + index + 1}"

    def describe(self, task_id: str) -> dict[str, Any]:
        prefix, _, number = task_id.partition("/")
        if prefix != "count" or not number.isdigit():
            raise UnknownTaskError(f"unknown task id {task_id!r}")
        n = int(number)
        if 1 <= n <= 20:
            return {"split": "train", "ticks": n}
        if 101 <= n <= 105:
            return {"split": "test", "ticks": n - 100}
        raise UnknownTaskError(f"unknown task id {task_id!r}")


class CountdownEnv(Environment):
    """Actions: `tick` (counts down), `crash` (raises), `hang S` (sleeps S seconds)."""

    name = "countdown"
    instances = 0
    closed = 0
    lock = threading.Lock()

    def __init__(self) -> None:
        with CountdownEnv.lock:
            CountdownEnv.instances += 1
        self.left = 0
        self.total = 0

    @classmethod
    def catalog(cls) -> TaskCatalog:
        return CountdownCatalog()

    def reset(self, task_id: str) -> ResetResult:
        self.total = self.left = CountdownCatalog().describe(task_id)["ticks"]
        return ResetResult(observation=f"Say tick {self.left} times.", available_actions=["tick"])

    def step(self, action: str) -> StepResult:
        if action == "crash":
            raise RuntimeError("simulated engine crash")
        if action.startswith("hang "):
            time.sleep(float(action.split()[1]))
        if action != "tick":
            return StepResult(
                observation=f"Unknown action {action!r}. Valid actions: tick.",
                reward=0.0,
                done=False,
                info={"invalid_action": True, "success": False},
            )
        self.left -= 1
        done = self.left == 0
        return StepResult(
            observation="Done!" if done else f"{self.left} to go.",
            reward=1.0 if done else 0.0,
            done=done,
            score=1.0 if done else 0.0,
            available_actions=["tick"],
            info={"invalid_action": False, "success": done},
        )

    def observe(self) -> str:
        return f"{self.left} to go."

    def available_actions(self) -> list[str] | None:
        return ["tick"]

    def close(self) -> None:
        with CountdownEnv.lock:
            CountdownEnv.closed += 1


def make_manager(**config: Any) -> EpisodeManager:
    settings = {"max_episodes": 8, "step_timeout_s": 0.5, "worker_threads": 4, **config}
    return EpisodeManager("countdown", CountdownEnv, CountdownCatalog(), ManagerConfig(**settings))
