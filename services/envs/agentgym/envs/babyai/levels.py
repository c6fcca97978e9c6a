"""The BabyAI task catalog: 40 minigrid levels x seeds, split into train and test.

A task is one (level, seed) pair: minigrid's level generators are deterministic given the seed,
so the task id alone pins the whole episode layout. Ids read ``<Level>/s<seed>``, e.g.
``GoToRedBall/s1000003``. The split is a function of the seed alone: test seeds are
``0 .. TEST_PER_LEVEL - 1`` and train seeds start at ``TRAIN_SEED_START``, so the two splits
can never share a layout.

Within a split, index ``i`` is level ``LEVELS[i % 40]`` with the ``i // 40``-th seed of that
split, so any prefix of a split (``task_ids("test", limit=200)``) covers all levels evenly.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from agentgym.envs.babyai.names import LEVEL_INDEX, LEVELS, gym_id
from agentgym.envs.base import TaskCatalog, UnknownTaskError

__all__ = [
    "LEVELS",
    "LEVEL_SUBSETS",
    "TEST_PER_LEVEL",
    "TEST_SEED_START",
    "TRAIN_PER_LEVEL",
    "TRAIN_SEED_START",
    "BabyAICatalog",
    "BabyAITask",
    "catalog",
    "gym_id",
    "parse_task_id",
]

TEST_PER_LEVEL = 25
TRAIN_PER_LEVEL = 1000
TEST_SEED_START = 0
TRAIN_SEED_START = 1_000_000

_SPLIT_SEEDS: dict[str, tuple[int, int]] = {
    # split -> (first seed, seeds per level)
    "train": (TRAIN_SEED_START, TRAIN_PER_LEVEL),
    "test": (TEST_SEED_START, TEST_PER_LEVEL),
}

# Views of the splits over a few levels, for quick runs (the CPU quickstart): "<split>-<subset>".
# Their task ids are the ordinary ones (a subset task is also a task of the base split).
LEVEL_SUBSETS: dict[str, tuple[str, ...]] = {
    "easy": ("GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists"),
    # Where the horizon matters (the horizon study): the expert needs a median 5-6 turns (open a door, then act
    # beyond it), against 1 on the GoTo levels, whose "go to" actions walk the whole way in one turn.
    "doors": ("OpenRedDoor", "PickupLoc", "OpenDoorLoc"),
}

_TASK_ID_RE = re.compile(r"^(?P<level>[A-Za-z0-9]+)/s(?P<seed>0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class BabyAITask:
    """One catalog task: a level, a seed, and the split that seed belongs to."""

    level: str
    seed: int
    split: str

    @property
    def task_id(self) -> str:
        return f"{self.level}/s{self.seed}"

    @property
    def gym_id(self) -> str:
        return gym_id(self.level)


def _split_of_seed(seed: int) -> str | None:
    for split, (first, count) in _SPLIT_SEEDS.items():
        if first <= seed < first + count:
            return split
    return None


def parse_task_id(task_id: str) -> BabyAITask:
    """The task named by `task_id`. Raises UnknownTaskError for anything not in the catalog."""
    match = _TASK_ID_RE.match(task_id) if isinstance(task_id, str) else None
    if match is None:
        raise UnknownTaskError(
            f"malformed BabyAI task id {task_id!r}; expected '<Level>/s<seed>', e.g. 'GoToRedBall/s0'"
        )
    level, seed = match["level"], int(match["seed"])
    if level not in LEVEL_INDEX:
        raise UnknownTaskError(f"unknown BabyAI level {level!r} in task id {task_id!r}")
    split = _split_of_seed(seed)
    if split is None:
        ranges = ", ".join(f"{name}: {first}..{first + count - 1}" for name, (first, count) in _SPLIT_SEEDS.items())
        raise UnknownTaskError(f"seed {seed} of task id {task_id!r} is in no split ({ranges})")
    return BabyAITask(level=level, seed=seed, split=split)


class BabyAICatalog(TaskCatalog):
    """Tasks ``<Level>/s<seed>``: 40 levels x (1000 train + 25 test) seeds."""

    def splits(self) -> dict[str, int]:
        splits = {split: count * len(LEVELS) for split, (_, count) in _SPLIT_SEEDS.items()}
        for subset, levels in LEVEL_SUBSETS.items():
            for split, (_, count) in _SPLIT_SEEDS.items():
                splits[f"{split}-{subset}"] = count * len(levels)
        return splits

    def task(self, split: str, index: int) -> BabyAITask:
        """The `index`-th task of `split` (levels interleaved, then seeds ascending)."""
        self._check_split_index(split, index)
        base, _, subset = split.partition("-")
        levels = LEVEL_SUBSETS[subset] if subset else LEVELS
        first, _ = _SPLIT_SEEDS[base]
        level_index, seed_offset = index % len(levels), index // len(levels)
        return BabyAITask(level=levels[level_index], seed=first + seed_offset, split=base)

    def task_id(self, split: str, index: int) -> str:
        return self.task(split, index).task_id

    def index_of(self, task_id: str) -> int:
        """Inverse of `task_id`: the index of `task_id` within its split."""
        task = parse_task_id(task_id)
        first, _ = _SPLIT_SEEDS[task.split]
        return (task.seed - first) * len(LEVELS) + LEVEL_INDEX[task.level]

    def describe(self, task_id: str) -> dict[str, Any]:
        """Split, level, gym id, seed, plus the mission and step limit (generates the level: ~ms)."""
        # Imported here so that listing tasks does not need minigrid loaded.
        from agentgym.envs.babyai.engine import generate_level

        task = parse_task_id(task_id)
        level_env, _ = generate_level(task.level, task.seed)
        return {
            "task_id": task.task_id,
            "split": task.split,
            "index": self.index_of(task_id),
            "level": task.level,
            "gym_id": task.gym_id,
            "seed": task.seed,
            "mission": level_env.mission,
            "max_steps": level_env.max_steps,
            "grid_size": [level_env.width, level_env.height],
        }


_catalog: BabyAICatalog | None = None
_catalog_lock = threading.Lock()


def catalog() -> BabyAICatalog:
    """The process-wide catalog (immutable, built once)."""
    global _catalog
    with _catalog_lock:
        if _catalog is None:
            _catalog = BabyAICatalog()
        return _catalog
