"""Environment kinds of the platform, usable in-process (`make`) or behind a service.

>>> env = agentgym.envs.make("babyai")
>>> first = env.reset(env.catalog().task_id("test", 0))
>>> result = env.step("turn left")
"""

from __future__ import annotations

import importlib
from typing import Any

from agentgym.environments import ENVIRONMENTS
from agentgym.envs.base import (
    Environment,
    EnvironmentBusyError,
    Expert,
    ResetResult,
    StepResult,
    TaskCatalog,
    UnknownTaskError,
)

# name -> "module:Class", from the environment cards. Imported lazily: each service image installs only its own engine.
ENVIRONMENT_CLASSES: dict[str, str] = {name: card.environment_class for name, card in ENVIRONMENTS.items()}
EXPERT_CLASSES: dict[str, str] = {name: card.expert_class for name, card in ENVIRONMENTS.items()}


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
