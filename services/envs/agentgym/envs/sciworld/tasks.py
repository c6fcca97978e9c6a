"""SciWorld tasks: ScienceWorld's 30 tasks x their variations, with ScienceWorld's own splits.

Task ids are ``<task name>/v<variation>``, e.g. ``boil/v12`` (ScienceWorld task 1-1, variation 12).

Splits (deterministic, from the simulator's own train/dev/test variation split of every task, which
`variations.json` records; a test checks it against the jar):

* ``train``, ``dev``, ``test``: the 23 tasks AgentGym uses, i.e. without 5-1, 5-2, 9-1, 9-2, 9-3,
  10-1 and 10-2 (AgentGym's exclusions), ordered by task number then variation;
* ``all``: every variation of those 23 tasks in AgentGym's ``data_idx`` order (tasks in
  ScienceWorld's task order, each task's variations 0..n-1), so ``all[data_idx]`` is the task that
  AgentGym's ``/reset {data_idx}`` loads;
* ``train_full``, ``dev_full``, ``test_full``: the same splits over all 30 tasks;
* ``train-short``, ``dev-short``, ``test-short``: views of the splits holding only `SHORT_TASKS`, the four
  tasks the expert solves in 5-7 actions (finding a non-living thing; the animals' life spans), for recipes
  on small machines. A task keeps its id and its split.

Tasks of the excluded kinds have ids too (``grow-plant/v3``), are described and can be played;
they are only left out of the default splits.

Refresh `variations.json` after a `scienceworld` upgrade with
``python -m agentgym.envs.sciworld.tasks`` (it starts a JVM and reads every task's splits).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from agentgym.envs.base import TaskCatalog, UnknownTaskError

if TYPE_CHECKING:
    from agentgym.envs.sciworld.jvm import Simulator

AGENTGYM_EXCLUDED: frozenset[str] = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
SPLITS: tuple[str, ...] = ("train", "dev", "test")
# The tasks the expert solves in 5-7 actions (the others take 10-41): the ``-short`` views, for CPU recipes.
SHORT_TASKS: frozenset[str] = frozenset(
    {
        "find-non-living-thing",
        "lifespan-longest-lived",
        "lifespan-shortest-lived",
        "lifespan-longest-lived-then-shortest-lived",
    }
)
DATA_FILE = "variations.json"
_TASK_ID = re.compile(r"^(?P<name>[a-z0-9-]+)/v(?P<variation>0|[1-9][0-9]*)$")


@dataclass(frozen=True, slots=True)
class TaskKind:
    """One of ScienceWorld's 30 tasks."""

    number: str  # "1-1"
    name: str  # "boil": ScienceWorld's task name
    topic: str  # "Matter"
    title: str  # "Changes of State (Boiling)"
    variations: int
    ranges: Mapping[str, range]  # split -> its variations
    excluded: bool  # left out by AgentGym

    def split_of(self, variation: int) -> str:
        for split, block in self.ranges.items():
            if variation in block:
                return split
        raise UnknownTaskError(f"task {self.name} has variations 0..{self.variations - 1}, not {variation}")


@dataclass(frozen=True, slots=True)
class TaskInfo:
    task_id: str
    kind: TaskKind
    variation: int
    split: str

    @property
    def task_name(self) -> str:
        return self.kind.name


def task_id_for(task_name: str, variation: int) -> str:
    return f"{task_name}/v{variation}"


class SciWorldCatalog(TaskCatalog):
    """ScienceWorld's task variations by id, by (split, index), and by AgentGym data_idx."""

    def __init__(self, kinds: Sequence[TaskKind]) -> None:
        self.kinds: tuple[TaskKind, ...] = tuple(kinds)
        self._by_name: Mapping[str, TaskKind] = MappingProxyType({kind.name: kind for kind in self.kinds})
        self._by_number: Mapping[str, TaskKind] = MappingProxyType({kind.number: kind for kind in self.kinds})
        # Each split is a list of (kind, range) blocks; an index is found by walking the blocks.
        blocks: dict[str, list[tuple[TaskKind, range]]] = {}
        for split in SPLITS:
            blocks[split] = [(k, k.ranges[split]) for k in self.kinds if not k.excluded and k.ranges[split]]
            blocks[f"{split}_full"] = [(k, k.ranges[split]) for k in self.kinds if k.ranges[split]]
            blocks[f"{split}-short"] = [(k, k.ranges[split]) for k in self.kinds if k.name in SHORT_TASKS]
        blocks["all"] = [(k, range(k.variations)) for k in self.kinds if not k.excluded]
        order = ["train", "dev", "test", "all", "train_full", "dev_full", "test_full"]
        order += [f"{split}-short" for split in SPLITS]
        self._blocks: Mapping[str, tuple[tuple[TaskKind, range], ...]] = MappingProxyType(
            {name: tuple(blocks[name]) for name in order}
        )
        self._sizes = {name: sum(len(block) for _, block in self._blocks[name]) for name in order}
        offsets: dict[str, int] = {}
        position = 0
        for kind, block in self._blocks["all"]:
            offsets[kind.name] = position
            position += len(block)
        self._agentgym_offset: Mapping[str, int] = MappingProxyType(offsets)

    # -- TaskCatalog -----------------------------------------------------------------------------

    def splits(self) -> dict[str, int]:
        return dict(self._sizes)

    def task_id(self, split: str, index: int) -> str:
        self._check_split_index(split, index)
        for kind, block in self._blocks[split]:
            if index < len(block):
                return task_id_for(kind.name, block[index])
            index -= len(block)
        raise AssertionError("unreachable: index checked against the split size")

    def describe(self, task_id: str) -> dict[str, Any]:
        info = self.info(task_id)
        kind = info.kind
        return {
            "split": info.split,
            "task_name": kind.name,
            "task_number": kind.number,
            "topic": kind.topic,
            "title": kind.title,
            "variation": info.variation,
            "variations": kind.variations,
            "agentgym_excluded": kind.excluded,
            "agentgym_data_idx": self.agentgym_data_idx(task_id),
        }

    # -- SciWorld specifics ----------------------------------------------------------------------

    def info(self, task_id: str) -> TaskInfo:
        """Parse and check a task id. Raises UnknownTaskError."""
        match = _TASK_ID.match(task_id) if isinstance(task_id, str) else None
        if match is None:
            raise UnknownTaskError(f"unknown task id {task_id!r}; SciWorld ids look like 'boil/v12'")
        kind = self._by_name.get(match["name"])
        if kind is None:
            raise UnknownTaskError(f"unknown SciWorld task {match['name']!r} in {task_id!r}")
        variation = int(match["variation"])
        return TaskInfo(task_id, kind, variation, kind.split_of(variation))

    def kind(self, name_or_number: str) -> TaskKind:
        kind = self._by_name.get(name_or_number) or self._by_number.get(name_or_number)
        if kind is None:
            raise UnknownTaskError(f"unknown SciWorld task {name_or_number!r}")
        return kind

    def from_agentgym(self, data_idx: int) -> str:
        """The task id that AgentGym's `/reset {data_idx}` loads. Raises UnknownTaskError."""
        if not isinstance(data_idx, int) or isinstance(data_idx, bool):
            raise UnknownTaskError(f"data_idx must be an integer, not {data_idx!r}")
        return self.task_id("all", data_idx)

    def agentgym_data_idx(self, task_id: str) -> int | None:
        info = self.info(task_id)
        offset = self._agentgym_offset.get(info.kind.name)
        return None if offset is None else offset + info.variation


def _load_kinds(table: Sequence[Mapping[str, Any]]) -> list[TaskKind]:
    from scienceworld.constants import TASKS

    by_number = {row["task_id"]: row for row in table}
    kinds: list[TaskKind] = []
    for task in TASKS:  # ScienceWorld's task order (AgentGym's data_idx order)
        row = by_number.get(task["task_id"])
        if row is None or row["name"] != task["task_name"]:
            raise RuntimeError(
                f"{DATA_FILE} does not match the installed scienceworld (task {task['task_id']}); "
                "regenerate it with `python -m agentgym.envs.sciworld.tasks`"
            )
        ranges = {split: range(*row[split]) for split in SPLITS}
        kinds.append(
            TaskKind(
                number=task["task_id"],
                name=task["task_name"],
                topic=task["topic"],
                title=task["task"],
                variations=int(row["variations"]),
                ranges=MappingProxyType(ranges),
                excluded=task["task_id"] in AGENTGYM_EXCLUDED,
            )
        )
    return kinds


@lru_cache(maxsize=1)
def load_catalog() -> SciWorldCatalog:
    """The catalog from the shipped variation table (no JVM needed)."""
    text = resources.files("agentgym.envs.sciworld").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return SciWorldCatalog(_load_kinds(json.loads(text)["tasks"]))


def read_variation_table(simulator: Simulator) -> list[dict[str, Any]]:
    """Every task's variation count and train/dev/test ranges, as the simulator reports them."""
    from scienceworld.constants import TASKS

    rows: list[dict[str, Any]] = []
    for task in TASKS:
        name = task["task_name"]
        count = simulator.max_variations(name)
        simulator.load(name, 0)
        row: dict[str, Any] = {"task_id": task["task_id"], "name": name, "variations": count}
        for split, variations in zip(SPLITS, simulator.variations(), strict=True):
            first, end = (min(variations), max(variations) + 1) if variations else (0, 0)
            if sorted(variations) != list(range(first, end)):
                raise RuntimeError(f"{name}: the {split} variations are not one contiguous range")
            row[split] = [first, end]
        rows.append(row)
    return rows


def main() -> None:
    """Rewrite variations.json from the installed scienceworld jar."""
    from scienceworld.version import __version__

    from agentgym.envs.sciworld.jvm import JVMSettings, ScienceWorldJVM

    jvm = ScienceWorldJVM(JVMSettings(cds="off"))
    try:
        rows = read_variation_table(jvm.add_simulator())
    finally:
        jvm.close()
    path = Path(__file__).with_name(DATA_FILE)
    body = {"scienceworld": __version__, "ranges": "[first, end) variation indices per split", "tasks": rows}
    lines = ",\n".join("    " + json.dumps(row) for row in rows)
    header = json.dumps({k: v for k, v in body.items() if k != "tasks"}, indent=2)[:-2]
    path.write_text(f'{header},\n  "tasks": [\n{lines}\n  ]\n}}\n', encoding="utf-8")
    print(f"wrote {path} ({len(rows)} tasks)")


if __name__ == "__main__":
    main()
