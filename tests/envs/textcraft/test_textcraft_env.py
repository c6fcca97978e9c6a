"""TextCraftEnv: observations, the three actions, rewards, invalid text, episode isolation."""

from __future__ import annotations

import gc
import threading
import tracemalloc

import pytest

import agentgym.envs
from agentgym.envs.base import EpisodeNotStartedError, StepResult, UnknownTaskError
from agentgym.envs.textcraft.env import TextCraftEnv
from agentgym.envs.textcraft.recipes import load_recipe_book

SIGN = "craft/minecraft:dark_oak_sign"


@pytest.fixture
def env() -> TextCraftEnv:
    environment = TextCraftEnv()
    environment.reset(SIGN)
    return environment


def run(env: TextCraftEnv, *actions: str) -> StepResult:
    result = None
    for action in actions:
        result = env.step(action)
        assert result.info["invalid_action"] is False, (action, result.observation)
    assert result is not None
    return result


def test_make_and_catalog() -> None:
    env = agentgym.envs.make("textcraft")
    assert isinstance(env, TextCraftEnv) and env.name == "textcraft"
    assert env.catalog() is TextCraftEnv.catalog()
    assert env.catalog().splits()["all"] == 544
    with pytest.raises(TypeError):
        agentgym.envs.make("textcraft", unknown_option=1)
    with pytest.raises(ValueError):
        TextCraftEnv(max_steps=0)


def test_reset_observation() -> None:
    env = TextCraftEnv()
    first = env.reset(SIGN)
    head, _, goal = first.observation.partition("\n\n")
    assert head.startswith("Crafting commands:\n")
    assert goal == "Goal: craft dark oak sign."
    lines = head.splitlines()[1:]
    assert "craft 3 dark oak sign using 6 dark oak planks, 1 stick" in lines
    assert "craft 4 dark oak planks using 1 dark oak logs" in lines
    assert "craft 4 stick using 2 planks" in lines
    assert first.info == {"task_id": SIGN, "goal": "minecraft:dark_oak_sign", "depth": 2, "split": "train"}
    assert first.available_actions is None
    assert env.observe() == first.observation


def test_observations_are_deterministic_per_task() -> None:
    catalog = TextCraftEnv.catalog()
    ids = catalog.task_ids("test")[:20]
    first = [TextCraftEnv().reset(task_id).observation for task_id in ids]
    second = [TextCraftEnv().reset(task_id).observation for task_id in ids]
    assert first == second
    assert len(set(first)) == len(first)
    env = TextCraftEnv()
    again = [env.reset(task_id).observation for task_id in reversed(ids)]
    assert again == first[::-1]


def test_get(env: TextCraftEnv) -> None:
    result = env.step("get 2 dark oak logs")
    assert result.observation == "Got 2 dark oak logs"
    assert (result.reward, result.done, result.truncated, result.score) == (0.0, False, False, 0.0)
    assert result.info == {"invalid_action": False, "success": False, "steps": 1}
    assert env.step("Get 1 minecraft:dark_oak_logs.").observation == "Got 1 dark oak logs"
    assert env.inventory == {"minecraft:dark_oak_logs": 3}


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ("get 1 stick", "Could not find stick: it has to be crafted"),
        ("get 1 planks", "Could not find planks: it names a group of items"),
        ("get 3 unobtainium", "Could not find unobtainium: there is no such item"),
        ("get 0 oak logs", "Could not get 0 oak logs: the amount must be at least 1"),
    ],
)
def test_get_failures(env: TextCraftEnv, action: str, expected: str) -> None:
    result = env.step(action)
    assert result.observation.startswith(expected)
    assert result.info["invalid_action"] is False and result.reward == 0.0
    assert env.inventory == {}


def test_inventory(env: TextCraftEnv) -> None:
    assert env.step("inventory").observation == "Inventory: You are not carrying anything."
    run(env, "get 1 oak logs", "get 2 string")
    assert env.step("inventory").observation == "Inventory: [oak logs] (1) [string] (2)"
    run(env, "craft 4 oak planks using 1 oak logs")
    assert env.step("Inventory").observation == "Inventory: [string] (2) [oak planks] (4)"


def test_craft_and_multiples(env: TextCraftEnv) -> None:
    run(env, "get 3 dark oak logs")
    assert env.step("craft 4 dark oak planks using 1 dark oak logs").observation == (
        "Crafted 4 minecraft:dark_oak_planks"
    )
    # a whole multiple of the recipe crafts that many batches
    assert env.step("craft 8 dark oak planks using 2 dark oak logs").observation == (
        "Crafted 8 minecraft:dark_oak_planks"
    )
    # the number before the output is informational (ADaPT): the ingredients decide the amount
    run(env, "get 1 oak logs")
    assert env.step("craft 1 oak planks using 1 oak logs").observation == "Crafted 4 minecraft:oak_planks"
    # a tag ingredient takes any member
    assert env.step("craft 4 stick using 2 oak planks").observation == "Crafted 4 minecraft:stick"
    assert env.inventory == {"minecraft:dark_oak_planks": 12, "minecraft:oak_planks": 2, "minecraft:stick": 4}


@pytest.mark.parametrize("phrasing", ["1 oak logs", "1 oak log"])
def test_what_was_got_crafts_whichever_way_it_is_named(env: TextCraftEnv, phrasing: str) -> None:
    # The recipe takes Minecraft's oak_logs tag (spelled as one item, "oak logs"); an oak log is one of them.
    assert env.step("get 1 oak log").observation == "Got 1 oak log"
    assert env.step("inventory").observation == "Inventory: [oak log] (1)"
    assert env.step(f"craft 4 oak planks using {phrasing}").observation == "Crafted 4 minecraft:oak_planks"
    assert env.inventory == {"minecraft:oak_planks": 4}


def test_singular_and_plural_names_and_tag_members() -> None:
    env = TextCraftEnv()
    env.reset("craft/minecraft:campfire")  # 3 logs, 3 stick, 1 coals: two of them groups
    run(env, "get 2 oak logs", "get 1 stripped birch log", "get 1 crimson stem", "get 1 coal")
    # the group "oak logs" held counts for an oak log, and a name that is not an item is read as its
    # singular or plural ("oak plank", "sticks")
    assert env.step("craft 4 oak planks using 1 oak log").observation == "Crafted 4 minecraft:oak_planks"
    assert env.step("craft 4 sticks using 2 oak plank").observation == "Crafted 4 minecraft:stick"
    # "logs" takes any log, the named one first, then every other member held
    result = env.step("craft 1 campfire using 3 logs, 3 sticks, 1 coals")
    assert result.observation == "Crafted 1 minecraft:campfire" and result.reward == 1.0
    assert env.inventory == {"minecraft:oak_planks": 2, "minecraft:stick": 1, "minecraft:campfire": 1}


def test_a_specific_item_is_still_required_where_the_recipe_names_it() -> None:
    env = TextCraftEnv()
    env.reset("craft/minecraft:oak_wood")  # 4 oak log: the item, not the group
    run(env, "get 4 oak logs")
    failed = env.step("craft 3 oak wood using 4 oak log")
    assert failed.observation == (
        "Could not find enough items to craft minecraft:oak_wood: 4 oak log needed, 0 in the inventory."
    )
    run(env, "get 4 oak log")
    assert env.step("craft 3 oak wood using 4 oak log").observation == "Crafted 3 minecraft:oak_wood"
    assert env.inventory == {"minecraft:oak_logs": 4, "minecraft:oak_wood": 3}


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        # wrong quantities (not the recipe's, nor a whole multiple of all of them)
        (
            "craft 3 dark oak sign using 5 dark oak planks, 1 stick",
            "Could not find a valid recipe for minecraft:dark_oak_sign: the ingredient quantities do not match",
        ),
        (
            "craft 6 dark oak sign using 12 dark oak planks, 1 stick",
            "Could not find a valid recipe for minecraft:dark_oak_sign: the ingredient quantities do not match",
        ),
        # wrong ingredients
        (
            "craft 3 dark oak sign using 6 oak planks, 1 stick",
            "Could not find a valid recipe for minecraft:dark_oak_sign using 6 oak planks, 1 stick: no recipe",
        ),
        (
            "craft 3 dark oak sign using 6 dark oak planks, 1 stick, 1 string",
            "Could not find a valid recipe for minecraft:dark_oak_sign using",
        ),
        ("craft 4 stick using 2 oak logs", "Could not find a valid recipe for minecraft:stick using 2 oak logs"),
        # outputs that cannot be crafted
        ("craft 1 oak logs using 1 oak planks", "Could not find a valid recipe for minecraft:oak_logs: it is a base"),
        ("craft 1 unobtainium using 1 stick", "Could not find a valid recipe for minecraft:unobtainium: there is no"),
        ("craft 4 planks using 1 oak logs", "Could not find a valid recipe for minecraft:planks: planks names a group"),
        ("craft 4 stick using 0 oak planks", "Could not find a valid recipe for minecraft:stick: ingredient amounts"),
        # valid recipe, missing items
        (
            "craft 3 dark oak sign using 6 dark oak planks, 1 stick",
            "Could not find enough items to craft minecraft:dark_oak_sign: 6 dark oak planks needed, 4 in",
        ),
        (
            "craft 4 stick using 2 planks",
            "Could not find enough items to craft minecraft:stick: planks names a group of items",
        ),
    ],
)
def test_craft_failures(env: TextCraftEnv, action: str, expected: str) -> None:
    run(env, "get 1 dark oak logs", "craft 4 dark oak planks using 1 dark oak logs")
    before = env.inventory
    result = env.step(action)
    assert result.observation.startswith(expected), result.observation
    assert result.info == {"invalid_action": False, "success": False, "steps": 3}
    assert (result.reward, result.done) == (0.0, False)
    assert env.inventory == before


@pytest.mark.parametrize(
    "action",
    ["", "   ", "dance", "get oak logs", "get two oak logs", "craft stick", "craft 4 stick using two planks", 42],
)
def test_invalid_text(env: TextCraftEnv, action: object) -> None:
    result = env.step(action)  # type: ignore[arg-type]
    assert result.info["invalid_action"] is True and result.info["success"] is False
    assert (result.reward, result.done, result.truncated) == (0.0, False, False)
    assert "Valid commands are: 'get N item'" in result.observation
    assert "craft N item using M ingredient, K ingredient" in result.observation
    assert env.observe() == result.observation


def test_success_reward(env: TextCraftEnv) -> None:
    last = run(
        env,
        "get 2 dark oak logs",
        "craft 8 dark oak planks using 2 dark oak logs",
        "craft 4 stick using 2 dark oak planks",
    )
    assert last.reward == 0.0 and not last.done
    result = env.step("craft 3 dark oak sign using 6 dark oak planks, 1 stick")
    assert result.observation == "Crafted 3 minecraft:dark_oak_sign"
    assert (result.reward, result.done, result.truncated, result.score) == (1.0, True, False, 1.0)
    assert result.info["success"] is True and result.info["invalid_action"] is False
    after = env.step("inventory")
    assert after.info.get("episode_over") is True and after.reward == 0.0 and after.done and after.score == 1.0


def test_crafting_a_non_goal_gives_no_reward(env: TextCraftEnv) -> None:
    result = run(
        env, "get 1 oak logs", "craft 4 oak planks using 1 oak logs", "craft 1 crafting table using 4 oak planks"
    )
    assert result.observation == "Crafted 1 minecraft:crafting_table"
    assert (result.reward, result.done, result.score) == (0.0, False, 0.0)


def test_max_steps_truncates() -> None:
    env = TextCraftEnv(max_steps=2)
    env.reset(SIGN)
    assert env.step("inventory").truncated is False
    result = env.step("dance")
    assert result.truncated is True and result.done is False and result.info["success"] is False
    over = env.step("get 1 oak logs")
    assert over.truncated and over.info["episode_over"] and env.inventory == {}
    env.reset(SIGN)  # a reset starts over
    assert env.step("inventory").truncated is False


def test_success_on_the_last_allowed_step_is_not_truncated() -> None:
    env = TextCraftEnv(max_steps=2)
    env.reset("craft/minecraft:oak_planks")
    env.step("get 1 oak logs")
    result = env.step("craft 4 oak planks using 1 oak logs")
    assert result.done and result.reward == 1.0 and not result.truncated


def test_errors_before_reset_and_unknown_tasks() -> None:
    env = TextCraftEnv()
    with pytest.raises(EpisodeNotStartedError):
        env.step("inventory")
    with pytest.raises(EpisodeNotStartedError):
        env.observe()
    with pytest.raises(UnknownTaskError):
        env.reset("craft/minecraft:unobtainium")
    with pytest.raises(UnknownTaskError):
        env.reset("minecraft:dark_oak_sign")


def test_no_state_leaks_between_episodes() -> None:
    """The wheel's tree grew on every reset (shared list mutated); here nothing carries over."""
    book = load_recipe_book()
    recipe_count = len(book.recipes)
    sign_recipes = book.item_recipes("minecraft:dark_oak_sign")
    env = TextCraftEnv()
    first = env.reset(SIGN).observation
    for _ in range(5):
        run(env, "get 5 dark oak logs", "craft 4 dark oak planks using 1 dark oak logs")
        other = env.reset("craft/minecraft:lectern").observation
        assert env.inventory == {} and env.step("inventory").info["steps"] == 1
        assert env.reset(SIGN).observation == first
        assert env.inventory == {}
    assert len(book.recipes) == recipe_count
    assert book.item_recipes("minecraft:dark_oak_sign") == sign_recipes
    assert TextCraftEnv().reset("craft/minecraft:lectern").observation == other
    # two live instances do not share inventories
    a, b = TextCraftEnv(), TextCraftEnv()
    a.reset(SIGN)
    b.reset(SIGN)
    a.step("get 1 oak logs")
    assert a.inventory == {"minecraft:oak_logs": 1} and b.inventory == {}


def test_instances_share_the_recipe_book() -> None:
    a, b = TextCraftEnv(), TextCraftEnv()
    assert a._book is b._book is load_recipe_book()


def test_many_cycles_do_not_grow_memory() -> None:
    ids = TextCraftEnv.catalog().task_ids("all")

    def cycles(n: int) -> None:
        for i in range(n):
            env = TextCraftEnv()
            env.reset(ids[i % len(ids)])
            env.step("get 3 oak logs")
            env.step("craft 4 oak planks using 1 oak logs")
            env.step("nonsense")
            env.step("inventory")
            env.close()

    cycles(len(ids))  # warm the per-task observation cache
    gc.collect()
    tracemalloc.start()
    try:
        cycles(500)
        gc.collect()
        before, _ = tracemalloc.get_traced_memory()
        cycles(3000)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 200_000, (before, after)


def test_instances_in_worker_threads() -> None:
    ids = TextCraftEnv.catalog().task_ids("test")
    expected = {task_id: TextCraftEnv().reset(task_id).observation for task_id in ids}
    errors: list[str] = []

    def worker(offset: int) -> None:
        env = TextCraftEnv()
        for task_id in ids[offset::4]:
            if env.reset(task_id).observation != expected[task_id]:
                errors.append(task_id)
            env.step("get 1 oak logs")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_depth_subsets_are_views_of_the_base_splits() -> None:
    catalog = TextCraftEnv.catalog()
    splits = catalog.splits()
    # AgentGym's test set holds 31/41/25/3 goals of depth 1/2/3/4; the train split the other 94/250/92/8.
    assert [splits[f"test-depth{d}"] for d in (1, 2, 3, 4)] == [31, 41, 25, 3]
    assert [splits[f"train-depth{d}"] for d in (1, 2, 3, 4)] == [94, 250, 92, 8]
    assert splits["train-shallow"] == 344 and splits["test-shallow"] == 72
    shallow = catalog.task_ids("test-shallow")
    assert shallow == tuple(t for t in catalog.task_ids("test") if catalog.info(t).depth <= 2)  # same order
    assert catalog.task_id("test-depth2", 0) == catalog.task_ids("test-depth2")[0]
    # A subset's task is a task of its base split, and plays as one.
    assert catalog.describe(shallow[-1])["split"] == "test" and catalog.describe(shallow[-1])["depth"] == 2
    with pytest.raises(UnknownTaskError, match="unknown split 'test-depth5'"):
        catalog.task_ids("test-depth5")
