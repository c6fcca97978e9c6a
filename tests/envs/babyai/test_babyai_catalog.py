"""The BabyAI task catalog: sizes, splits, id format, determinism, unknown ids."""

from __future__ import annotations

import gymnasium
import pytest

from agentgym.envs import UnknownTaskError, environment_class
from agentgym.envs.babyai.levels import (
    LEVELS,
    TEST_PER_LEVEL,
    TRAIN_PER_LEVEL,
    TRAIN_SEED_START,
    BabyAICatalog,
    gym_id,
    parse_task_id,
)


@pytest.fixture(scope="module")
def catalog() -> BabyAICatalog:
    cat = environment_class("babyai").catalog()
    assert isinstance(cat, BabyAICatalog)
    return cat


def test_forty_distinct_registered_non_debug_levels() -> None:
    assert len(LEVELS) == 40
    assert len(set(LEVELS)) == 40
    import minigrid  # noqa: F401 - importing minigrid registers the BabyAI levels with gymnasium

    registered = set(gymnasium.registry)
    for level in LEVELS:
        assert "Debug" not in level
        assert gym_id(level) in registered


def test_split_sizes(catalog: BabyAICatalog) -> None:
    splits = catalog.splits()
    assert (splits["train"], splits["test"]) == (40 * TRAIN_PER_LEVEL, 40 * TEST_PER_LEVEL) == (40_000, 1_000)
    assert set(splits) == {"train", "test", "train-easy", "test-easy", "train-doors", "test-doors"}


def test_catalog_is_cached() -> None:
    cls = environment_class("babyai")
    assert cls.catalog() is cls.catalog()


def test_task_id_format_and_interleaving(catalog: BabyAICatalog) -> None:
    assert catalog.task_id("test", 0) == f"{LEVELS[0]}/s0"
    assert catalog.task_id("test", 1) == f"{LEVELS[1]}/s0"
    assert catalog.task_id("test", 40) == f"{LEVELS[0]}/s1"
    assert catalog.task_id("test", 999) == f"{LEVELS[39]}/s24"
    assert catalog.task_id("train", 0) == f"{LEVELS[0]}/s{TRAIN_SEED_START}"
    assert catalog.task_id("train", 40 * 3 + 1) == f"{LEVELS[1]}/s{TRAIN_SEED_START + 3}"
    # Any prefix of 40 tasks covers every level once.
    assert {tid.split("/")[0] for tid in catalog.task_ids("test", limit=40)} == set(LEVELS)


def test_splits_are_disjoint_and_deterministic(catalog: BabyAICatalog) -> None:
    test_ids = list(catalog.task_ids("test"))
    assert len(set(test_ids)) == len(test_ids) == 1_000
    train_sample = [catalog.task_id("train", i) for i in range(0, 40_000, 97)]
    assert not set(test_ids) & set(train_sample)
    assert list(catalog.task_ids("test")) == test_ids
    assert BabyAICatalog().task_id("train", 12_345) == catalog.task_id("train", 12_345)


def test_index_round_trip(catalog: BabyAICatalog) -> None:
    for split, index in [("test", 0), ("test", 537), ("train", 0), ("train", 39_999), ("train", 20_001)]:
        task_id = catalog.task_id(split, index)
        assert catalog.index_of(task_id) == index
        assert parse_task_id(task_id).split == split


def test_describe(catalog: BabyAICatalog) -> None:
    info = catalog.describe("GoToRedBall/s1000003")
    assert info["split"] == "train"
    assert info["level"] == "GoToRedBall"
    assert info["gym_id"] == "BabyAI-GoToRedBall-v0"
    assert info["seed"] == 1_000_003
    assert info["mission"] == catalog.describe("GoToRedBall/s1000003")["mission"]
    assert "ball" in info["mission"]
    assert info["max_steps"] > 0
    assert catalog.describe("GoToObjS6/s3")["gym_id"] == "BabyAI-GoToObjS6-v1"


@pytest.mark.parametrize(
    "task_id",
    [
        "",
        "GoToRedBall",
        "GoToRedBall/0",
        "GoToRedBall/s",
        "GoToRedBall/s01",
        "GoToRedBall/s-1",
        "gotoredball/s0",
        "NoSuchLevel/s0",
        "OpenDoorDebug/s0",
        "BabyAI-GoToRedBall-v0/s0",
        "GoToRedBall/s25",  # between the test and train seed ranges
        f"GoToRedBall/s{TRAIN_SEED_START + TRAIN_PER_LEVEL}",
    ],
)
def test_unknown_task_ids(catalog: BabyAICatalog, task_id: str) -> None:
    with pytest.raises(UnknownTaskError) as raised:
        catalog.describe(task_id)
    assert str(raised.value)  # a readable message, not a bare key
    with pytest.raises(UnknownTaskError):
        environment_class("babyai")().reset(task_id)


@pytest.mark.parametrize(("split", "index"), [("test", 1_000), ("test", -1), ("train", 40_000), ("valid", 0)])
def test_out_of_range(catalog: BabyAICatalog, split: str, index: int) -> None:
    with pytest.raises(UnknownTaskError, match=split):
        catalog.task_id(split, index)


def test_easy_subset_splits_are_views_over_three_levels() -> None:
    from agentgym.envs.babyai.levels import LEVEL_SUBSETS, catalog

    cat = catalog()
    splits = cat.splits()
    assert splits["train-easy"] == 3 * 1000 and splits["test-easy"] == 3 * 25
    ids = cat.task_ids("test-easy")
    assert ids[:4] == ["GoToRedBallGrey/s0", "GoToRedBall/s0", "GoToRedBallNoDists/s0", "GoToRedBallGrey/s1"]
    assert {i.split("/")[0] for i in ids} == set(LEVEL_SUBSETS["easy"])
    assert cat.describe(cat.task_id("train-easy", 5))["split"] == "train"  # ordinary task ids
    assert set(cat.task_ids("train-easy", limit=300)).isdisjoint(ids)


def test_the_doors_subset_needs_several_turns_where_easy_needs_one() -> None:
    # Why the horizon study plays `doors`: measured with the scripted expert on every held-out task.
    import statistics

    from agentgym.envs.babyai.expert import BabyAIExpert
    from agentgym.envs.babyai.levels import catalog

    cat, expert = catalog(), BabyAIExpert()
    doors = [len(expert.demonstrate(task)) for task in cat.task_ids("test-doors")]
    easy = [len(expert.demonstrate(task)) for task in cat.task_ids("test-easy")]
    assert len(doors) == 75 and statistics.median(doors) >= 5 and statistics.median(easy) <= 2
    within = {h: sum(n <= h for n in doors) / len(doors) for h in (3, 8)}
    assert within[3] < 0.35 and within[8] > 0.8  # a 3-turn horizon caps what can be solved; 8 turns rarely do
