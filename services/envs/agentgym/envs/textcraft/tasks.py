"""TextCraft tasks: the 544 goal items, their splits, and each task's crafting commands.

Task ids are ``craft/<item id>``, e.g. ``craft/minecraft:dark_oak_sign``.

Order and splits (all deterministic, independent of the machine and of Python's hash seed):

* ``all``: every goal, ordered like AgentGym's ``textcraft_<index>`` tasks, by crafting depth
  (125 of depth 1, then 291 of depth 2, 117 of depth 3, 11 of depth 4); within a depth AgentGym
  follows the file system's directory order, which differs between machines, so here the order
  is the SHA-256 of ``textcraft:<item id>``;
* ``test``: the 100 positions of AgentGym's TextCraft test set (``textcraft_0..30``, ``140..180``,
  ``420..444``, ``533..535``) taken in that order: 31/41/25/3 goals of depth 1/2/3/4, as in AgentGym;
* ``train``: the other 444 goals, in ``all`` order. (AgentGym's training file lists 374 of them.)
* ``<split>-<subset>``: views of ``train``/``test`` by crafting depth, in the same order, for quick runs
  (the CPU recipe): ``depth1`` .. ``depth4``, and ``shallow`` (depths 1 and 2: 344 train, 72 test goals). Their
  task ids are the ordinary ones and a task's split stays its base split.

The crafting commands of a task are ADaPT's: every recipe reachable from the goal (all of each
ingredient's alternatives, and every member's recipes for a tag such as planks) plus up to 10
distractor recipes that use the same ingredients, shuffled. The choice and order come from a
random generator seeded with the task id, so a task always shows the same observation.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any

from agentgym.envs.base import TaskCatalog, UnknownTaskError
from agentgym.envs.textcraft.recipes import Recipe, RecipeBook, display_name, load_recipe_book

TASK_PREFIX = "craft/"
MAX_DISTRACTORS = 10
DISTRACTORS_PER_INGREDIENT = 10
# AgentGym's TextCraft test set, as positions in its depth-sorted goal list.
AGENTGYM_TEST_POSITIONS: tuple[range, ...] = (range(0, 31), range(140, 181), range(420, 445), range(533, 536))
# Depth views of the base splits: "<split>-<subset>" holds the split's goals of these crafting depths.
DEPTH_SUBSETS: dict[str, frozenset[int]] = {
    "depth1": frozenset({1}),
    "depth2": frozenset({2}),
    "depth3": frozenset({3}),
    "depth4": frozenset({4}),
    "shallow": frozenset({1, 2}),
}


def task_id_for(goal: str) -> str:
    return TASK_PREFIX + goal


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


@dataclass(frozen=True, slots=True)
class TaskInfo:
    task_id: str
    goal: str
    depth: int
    index: int  # position in the "all" split
    split: str  # "train" or "test"


class TextCraftCatalog(TaskCatalog):
    """The goals of a recipe book, by id or by (split, index)."""

    def __init__(self, book: RecipeBook) -> None:
        self.book = book
        ordered = sorted(book.goals(), key=lambda goal: (book.depth(goal), _stable_int("textcraft:" + goal)))
        test_positions = {i for block in AGENTGYM_TEST_POSITIONS for i in block if i < len(ordered)}
        infos: dict[str, TaskInfo] = {}
        splits: dict[str, list[str]] = {"all": [], "train": [], "test": []}
        for index, goal in enumerate(ordered):
            split = "test" if index in test_positions else "train"
            task_id = task_id_for(goal)
            infos[task_id] = TaskInfo(task_id, goal, book.depth(goal), index, split)
            splits["all"].append(task_id)
            splits[split].append(task_id)
        for base in ("train", "test"):
            for subset, depths in DEPTH_SUBSETS.items():
                splits[f"{base}-{subset}"] = [t for t in splits[base] if infos[t].depth in depths]
        self._infos: Mapping[str, TaskInfo] = MappingProxyType(infos)
        self._splits: Mapping[str, tuple[str, ...]] = MappingProxyType({k: tuple(v) for k, v in splits.items()})

    def splits(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in self._splits.items()}

    def task_id(self, split: str, index: int) -> str:
        self._check_split_index(split, index)
        return self._splits[split][index]

    def task_ids(self, split: str, limit: int | None = None) -> tuple[str, ...]:
        ids = self._splits.get(split)
        if ids is None:
            raise UnknownTaskError(f"unknown split {split!r}; splits are {sorted(self._splits)}")
        return ids if limit is None else ids[: max(limit, 0)]

    def info(self, task_id: str) -> TaskInfo:
        info = self._infos.get(task_id)
        if info is None:
            raise UnknownTaskError(f"unknown TextCraft task {task_id!r}; ids look like 'craft/minecraft:dark_oak_sign'")
        return info

    def describe(self, task_id: str) -> dict[str, Any]:
        info = self.info(task_id)
        return {
            "task_id": info.task_id,
            "split": info.split,
            "goal": info.goal,
            "goal_name": display_name(info.goal),
            "depth": info.depth,
            "index": info.index,
        }


_CATALOG: TextCraftCatalog | None = None
_CATALOG_LOCK = threading.Lock()


def load_catalog() -> TextCraftCatalog:
    """The process-wide catalog over the shared recipe book (thread-safe)."""
    global _CATALOG
    catalog = _CATALOG
    if catalog is None:
        with _CATALOG_LOCK:
            catalog = _CATALOG
            if catalog is None:
                catalog = _CATALOG = TextCraftCatalog(load_recipe_book())
    return catalog


def needed_recipes(book: RecipeBook, goal: str) -> tuple[Recipe, ...]:
    """Every recipe reachable from `goal` (all alternatives), in discovery order."""
    found: dict[Recipe, None] = {}
    seen: set[str] = set()
    stack = [goal]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for recipe in book.recipes_for(name):
            found.setdefault(recipe, None)
            stack.extend(ingredient.name for ingredient in reversed(recipe.ingredients))
    return tuple(found)


def crafting_commands(book: RecipeBook, goal: str, seed_text: str) -> tuple[str, ...]:
    """The shuffled recipe lines shown for `goal`: needed recipes plus distractors."""
    rng = random.Random(_stable_int(seed_text))
    needed = needed_recipes(book, goal)
    needed_lines = {recipe.command: None for recipe in needed}
    candidates: dict[str, None] = {}
    for recipe in needed:
        for ingredient in recipe.ingredients:
            uses = book.uses_of(ingredient.name)
            for use in rng.sample(uses, min(len(uses), DISTRACTORS_PER_INGREDIENT)):
                if use.command not in needed_lines:
                    candidates.setdefault(use.command, None)
    pool = list(candidates)
    distractors = rng.sample(pool, min(len(pool), MAX_DISTRACTORS))
    lines = [*needed_lines, *distractors]
    rng.shuffle(lines)
    return tuple(lines)


@lru_cache(maxsize=1024)
def _initial_observation(book: RecipeBook, goal: str, task_id: str) -> str:
    commands = "\n".join(crafting_commands(book, goal, task_id))
    return f"Crafting commands:\n{commands}\n\nGoal: craft {display_name(goal)}."


def initial_observation(book: RecipeBook, goal: str, task_id: str) -> str:
    """The reset observation of a task (cached: it is the same every time)."""
    return _initial_observation(book, goal, task_id)
