"""Thin access layer over minigrid's BabyAI levels: construction, seeding, and a quiet stdout.

Levels are built straight from their gymnasium registration (entry point + kwargs) instead of
``gymnasium.make``: the wrappers `make` adds (order enforcing, the passive env checker) cost time
and memory per instance and buy nothing here, since this package drives the raw level itself.

minigrid's level generator prints "Sampling rejected: ..." to stdout whenever it re-draws a
layout; an environment service must not leak that, so construction and resets run under
`quiet_stdout`.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium
import minigrid  # noqa: F401 - importing minigrid registers the BabyAI-* gymnasium ids
import numpy as np
from gymnasium.envs.registration import load_env_creator
from minigrid.envs.babyai.core.roomgrid_level import RoomGridLevel

from agentgym.envs.babyai.names import LEVELS, gym_id

# `contextlib.redirect_stdout` swaps the process-wide `sys.stdout`. Two threads doing it at once
# could restore each other's sink and leave stdout silenced for good, so all swaps go through
# one lock (level generation takes milliseconds, so the serialisation is cheap).
_STDOUT_LOCK = threading.Lock()


class _DiscardWriter(io.TextIOBase):
    """A text stream that drops everything written to it (keeps no buffer)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return len(text)


_DISCARD = _DiscardWriter()


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Discard anything printed to stdout inside the block (thread-safe, not reentrant)."""
    with _STDOUT_LOCK, contextlib.redirect_stdout(_DISCARD):
        yield


def _level_constructor(level: str) -> Callable[..., RoomGridLevel]:
    spec = gymnasium.spec(gym_id(level))
    if not isinstance(spec.entry_point, str):
        raise RuntimeError(f"unexpected entry point for {spec.id}: {spec.entry_point!r}")
    creator = load_env_creator(spec.entry_point)
    kwargs = dict(spec.kwargs)

    def construct(**overrides: Any) -> RoomGridLevel:
        env = creator(**kwargs, **overrides)
        if not isinstance(env, RoomGridLevel):
            raise RuntimeError(f"{spec.id} is not a BabyAI RoomGridLevel: {type(env).__name__}")
        return env

    return construct


# Built once at import (imports are serialised by Python's import lock) and never mutated after.
_CONSTRUCTORS: dict[str, Callable[..., RoomGridLevel]] = {level: _level_constructor(level) for level in LEVELS}


def make_level(level: str, max_steps: int | None = None) -> RoomGridLevel:
    """A new, not yet reset, level environment. `max_steps` fixes the primitive-step limit;
    None keeps the level's own limit (which BabyAI derives from the maze size and mission)."""
    overrides: dict[str, Any] = {}
    if max_steps is not None:
        overrides["max_steps"] = max_steps
    with quiet_stdout():
        return _CONSTRUCTORS[level](**overrides)


def reset_level(env: RoomGridLevel, seed: int) -> dict[str, Any]:
    """Generate the layout of `seed` in `env` (deterministic) and return the first observation."""
    with quiet_stdout():
        obs, _ = env.reset(seed=seed)
    image = obs["image"]
    if not isinstance(image, np.ndarray):
        raise RuntimeError("minigrid observation without an image")
    return dict(obs)


def generate_level(level: str, seed: int, max_steps: int | None = None) -> tuple[RoomGridLevel, dict[str, Any]]:
    """A fresh level environment reset to `seed`, with its first observation."""
    env = make_level(level, max_steps)
    return env, reset_level(env, seed)
