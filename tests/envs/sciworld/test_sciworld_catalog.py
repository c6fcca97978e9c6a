"""SciWorld's task catalog: ids, ScienceWorld's splits, AgentGym's exclusions and data_idx order."""

from __future__ import annotations

import pytest

from agentgym.envs import UnknownTaskError, environment_class
from agentgym.envs.sciworld.jvm import JVMSettings, ScienceWorldJVM, usable_archive
from agentgym.envs.sciworld.tasks import AGENTGYM_EXCLUDED, SHORT_TASKS, load_catalog, read_variation_table

catalog = load_catalog()


def test_thirty_tasks_in_scienceworld_order() -> None:
    numbers = [kind.number for kind in catalog.kinds]
    assert len(numbers) == 30
    assert numbers[:5] == ["1-1", "1-2", "1-3", "1-4", "2-1"] and numbers[-1] == "10-2"
    assert {k.number for k in catalog.kinds if k.excluded} == AGENTGYM_EXCLUDED
    assert {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"} == AGENTGYM_EXCLUDED


def test_split_sizes_follow_scienceworld_ranges() -> None:
    sizes = catalog.splits()
    assert sizes == {
        "train": 2312,
        "dev": 1156,
        "test": 1171,
        "all": 4639,
        "train_full": 3592,
        "dev_full": 1796,
        "test_full": 1819,
        "train-short": 336,
        "dev-short": 168,
        "test-short": 171,
    }
    assert sizes["train"] + sizes["dev"] + sizes["test"] == sizes["all"]
    boil = catalog.kind("boil")
    assert (boil.variations, boil.ranges["train"], boil.ranges["dev"], boil.ranges["test"]) == (
        30,
        range(0, 14),
        range(14, 21),
        range(21, 30),
    )


def test_task_ids_are_readable_stable_and_described() -> None:
    assert catalog.task_id("test", 0) == "boil/v21"
    assert catalog.task_id("train", 0) == "boil/v0"
    assert catalog.task_ids("test", limit=3) == ["boil/v21", "boil/v22", "boil/v23"]
    assert catalog.describe("use-thermometer/v440") == {
        "split": "test",
        "task_name": "use-thermometer",
        "task_number": "2-1",
        "topic": "Measurement",
        "title": "Use Thermometer",
        "variation": 440,
        "variations": 540,
        "agentgym_excluded": False,
        "agentgym_data_idx": 120 + 440,
    }
    # every id of every split parses back into the same split
    for split in ("train", "dev", "test"):
        size = catalog.splits()[split]
        for index in (0, size // 3, size - 1):
            task_id = catalog.task_id(split, index)
            assert catalog.describe(task_id)["split"] == split


def test_short_views_hold_the_short_tasks_of_each_split_with_their_ids() -> None:
    for split in ("train", "dev", "test"):
        view = catalog.task_ids(f"{split}-short")
        assert {task_id.split("/")[0] for task_id in view} == SHORT_TASKS
        assert set(view) == {t for t in catalog.task_ids(split) if t.split("/")[0] in SHORT_TASKS}
        assert {catalog.describe(t)["split"] for t in view} == {split}
    # 150 + 3 x 62 training variations: find-non-living-thing (4-2) first, then the life spans (7-1, 7-2, 7-3).
    assert catalog.task_id("train-short", 150) == "lifespan-longest-lived/v0"


def test_excluded_tasks_are_playable_but_only_in_full_splits() -> None:
    grow = catalog.describe("grow-plant/v100")
    assert grow["agentgym_excluded"] is True and grow["split"] == "test" and grow["agentgym_data_idx"] is None
    default = {catalog.describe(t)["task_number"] for t in catalog.task_ids("test")}
    full = {catalog.describe(t)["task_number"] for t in catalog.task_ids("test_full")}
    assert default.isdisjoint(AGENTGYM_EXCLUDED) and len(default) == 23
    assert full >= AGENTGYM_EXCLUDED and len(full) == 30


def test_agentgym_data_idx_order() -> None:
    # AgentGym: every variation of each kept task, in ScienceWorld's task order.
    assert catalog.from_agentgym(0) == "boil/v0"
    assert catalog.from_agentgym(29) == "boil/v29"
    assert catalog.from_agentgym(30) == "melt/v0"
    assert catalog.from_agentgym(120) == "use-thermometer/v0"
    # 4-4 (find-animal) is followed by 6-1: 5-1 and 5-2 are excluded
    last_4_4 = catalog.agentgym_data_idx("find-animal/v299")
    assert last_4_4 is not None and catalog.from_agentgym(last_4_4 + 1) == "chemistry-mix/v0"
    assert catalog.from_agentgym(4638) == "identify-life-stages-2/v9"
    for data_idx in (0, 57, 1234, 4638):
        assert catalog.agentgym_data_idx(catalog.from_agentgym(data_idx)) == data_idx
    with pytest.raises(UnknownTaskError, match="out of range"):
        catalog.from_agentgym(4639)
    with pytest.raises(UnknownTaskError):
        catalog.from_agentgym(-1)


@pytest.mark.parametrize(
    "bad",
    ["boil", "boil/12", "boil/v30", "boil/v-1", "boil/v01", "unknown-task/v0", "", "BOIL/v1", "boil/v1/extra"],
)
def test_unknown_task_ids(bad: str) -> None:
    with pytest.raises(UnknownTaskError):
        catalog.describe(bad)


def test_unknown_split_and_index() -> None:
    with pytest.raises(UnknownTaskError, match="unknown split"):
        catalog.task_id("validation", 0)
    with pytest.raises(UnknownTaskError, match="out of range"):
        catalog.task_id("test", 1171)


def test_environment_class_serves_the_catalog() -> None:
    cls = environment_class("sciworld")
    assert cls.name == "sciworld"
    assert cls.catalog().splits() == catalog.splits()


def test_shipped_variation_table_matches_the_jar() -> None:
    """variations.json is what the installed ScienceWorld jar reports (one JVM, ~5 s)."""
    settings = JVMSettings()
    jvm = ScienceWorldJVM(settings, archive=usable_archive(settings))
    try:
        table = read_variation_table(jvm.add_simulator())
    finally:
        jvm.close()
    for row, kind in zip(table, catalog.kinds, strict=True):
        assert (row["task_id"], row["name"], row["variations"]) == (kind.number, kind.name, kind.variations)
        for split in ("train", "dev", "test"):
            assert range(*row[split]) == kind.ranges[split], (kind.name, split)
