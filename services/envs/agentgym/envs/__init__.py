"""Environment kinds of the platform, usable in-process (`make`) or behind a service.

>>> env = agentgym.envs.make("babyai")
>>> first = env.reset(env.catalog().task_id("test", 0))
>>> result = env.step("turn left")
"""

from __future__ import annotations

import importlib
from typing import Any

from agentgym.envs.base import (
    Environment,
    EnvironmentBusyError,
    Expert,
    ResetResult,
    StepResult,
    TaskCatalog,
    UnknownTaskError,
)

# name -> "module:Class". Imported lazily: each service image installs only its own engine.
ENVIRONMENT_CLASSES: dict[str, str] = {
    "babyai": "agentgym.envs.babyai.env:BabyAIEnv",
    "textcraft": "agentgym.envs.textcraft.env:TextCraftEnv",
    "sciworld": "agentgym.envs.sciworld.env:SciWorldEnv",
    "deepsearch": "agentgym.envs.deepsearch.env:DeepSearchEnv",
    "webarena": "agentgym.envs.webarena.env:WebArenaEnv",
}
EXPERT_CLASSES: dict[str, str] = {
    "babyai": "agentgym.envs.babyai.expert:BabyAIExpert",
    "textcraft": "agentgym.envs.textcraft.expert:TextCraftExpert",
    "sciworld": "agentgym.envs.sciworld.expert:SciWorldExpert",
    "deepsearch": "agentgym.envs.deepsearch.expert:DeepSearchExpert",
    "webarena": "agentgym.envs.webarena.env:WebArenaExpert",
}


def _load(table: dict[str, str], name: str, what: str) -> Any:
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
    module_name, _, attr = table[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)


def environment_class(name: str) -> type[Environment]:
    cls: type[Environment] = _load(ENVIRONMENT_CLASSES, name, "environment")
    return cls


def make(name: str, **config: Any) -> Environment:
    """A new, not yet reset, environment instance of kind `name`."""
    return environment_class(name)(**config)


def make_expert(name: str, **config: Any) -> Expert:
    expert: Expert = _load(EXPERT_CLASSES, name, "expert")(**config)
    return expert


__all__ = [
    "ENVIRONMENT_CLASSES",
    "Environment",
    "EnvironmentBusyError",
    "Expert",
    "ResetResult",
    "StepResult",
    "TaskCatalog",
    "UnknownTaskError",
    "environment_class",
    "make",
    "make_expert",
]
