"""SciWorld expert: ScienceWorld's own gold action sequence for a task variation.

ScienceWorld generates a gold path when a task is loaded with ``generateGoldPath``; it is a winning
sequence for the world as reset (not necessarily the shortest, and it may run past the point where
the task completes: replay it until the episode is done). Generating one takes a few hundred
milliseconds to several seconds of JVM time (the genetics tasks are the slowest; the simulators
sharing that JVM wait meanwhile); it runs on a slot leased from the same pool the environment
uses, with the same keyword settings.
"""

from __future__ import annotations

from typing import Any

from agentgym.envs.sciworld.env import SlotDiedError, pool_settings
from agentgym.envs.sciworld.jvm import JVMDiedError
from agentgym.envs.sciworld.pool import SciWorldPool, shared_pool
from agentgym.envs.sciworld.tasks import load_catalog


class SciWorldExpert:
    """Gold action sequences, by task id."""

    def __init__(self, *, lease_timeout_s: float = 120.0, pool: SciWorldPool | None = None, **pool_config: Any):
        for key in ("step_limit", "valid_actions_in_step"):  # environment settings that mean nothing here
            pool_config.pop(key, None)
        self._pool = pool if pool is not None else shared_pool(pool_settings(**pool_config))
        self.lease_timeout_s = lease_timeout_s

    def demonstrate(self, task_id: str) -> list[str]:
        info = load_catalog().info(task_id)  # raises UnknownTaskError
        slot = self._pool.lease(self.lease_timeout_s)
        healthy = True
        try:
            slot.sim.load(info.task_name, info.variation, gold_path=True)
            actions = slot.sim.gold_actions()
        except JVMDiedError as error:
            healthy = False
            raise SlotDiedError(str(error)) from error
        finally:
            self._pool.release(slot, healthy=healthy and slot.alive())
        if not actions or actions[0].startswith("ERROR"):
            raise RuntimeError(f"ScienceWorld generated no gold path for {task_id}: {actions[:1]}")
        return actions
