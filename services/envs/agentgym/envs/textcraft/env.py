"""TextCraft: craft a Minecraft item from base materials by text commands (ADaPT / AgentGym).

On reset the agent sees the crafting commands that matter for the goal (plus distractors) and
the goal::

    Crafting commands:
    craft 3 dark oak sign using 6 dark oak planks, 1 stick
    craft 4 dark oak planks using 1 dark oak logs
    ...

    Goal: craft dark oak sign.

Actions and answers (ADaPT's wording):

* ``get 2 dark oak logs`` -> ``Got 2 dark oak logs``; only base items (those without a recipe)
  can be fetched, in any amount;
* ``craft 4 dark oak planks using 1 dark oak logs`` -> ``Crafted 4 minecraft:dark_oak_planks``;
  the ingredients must be a recipe's, with its quantities or a whole multiple of them (``using 2
  dark oak logs`` crafts 8); a tag ingredient (``planks``) takes any one kind (``oak planks``);
  the number before the output is informational, as in ADaPT: the amount crafted follows from
  the ingredients and is reported;
* what the agent holds can be named as it is held: a name that is not an item is read as its
  singular or plural (``oak plank`` -> ``oak planks``), and where a recipe takes a group of
  Minecraft items that the recipe data spells as one item (``1 oak logs``: any oak log or wood),
  a held member counts for it, named either way (``using 1 oak logs`` or ``using 1 oak log`` after
  ``get 1 oak log``); naming the group draws on any member held, the named item first;
* ``inventory`` -> ``Inventory: [dark oak planks] (4) [stick] (4)``.

Crafting the goal gives reward 1 and ends the episode (score 1, else 0). Text that is not one of
the three commands gets a reply listing them, reward 0 and ``info["invalid_action"] = True``.
With ``max_steps`` set, the episode is truncated after that many steps without success.
"""

from __future__ import annotations

from typing import Any, ClassVar

from agentgym.envs.base import Environment, EpisodeNotStartedError, ResetResult, StepResult
from agentgym.envs.textcraft.actions import HELP, Craft, Get, Invalid, Inventory, parse_action
from agentgym.envs.textcraft.recipes import Ingredient, Recipe, RecipeBook, display_name
from agentgym.envs.textcraft.tasks import TextCraftCatalog, initial_observation, load_catalog

EPISODE_OVER = "The episode is over; reset to start a new one."


class _CraftFailed(Exception):
    pass


class TextCraftEnv(Environment):
    """One TextCraft episode. Instances are light: the recipe book and catalog are shared."""

    name: ClassVar[str] = "textcraft"

    def __init__(self, max_steps: int | None = None) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be a positive number of steps or None, not {max_steps!r}")
        self.max_steps = max_steps
        self._catalog = load_catalog()
        self._book: RecipeBook = self._catalog.book
        self._task_id: str | None = None
        self._goal = ""
        self._inventory: dict[str, int] = {}
        self._observation = ""
        self._steps = 0
        self._success = False
        self._truncated = False

    @classmethod
    def catalog(cls) -> TextCraftCatalog:
        return load_catalog()

    # -- episode ------------------------------------------------------------------------------

    def reset(self, task_id: str) -> ResetResult:
        info = self._catalog.info(task_id)  # raises UnknownTaskError
        self._task_id = task_id
        self._goal = info.goal
        self._inventory = {}
        self._steps = 0
        self._success = False
        self._truncated = False
        self._observation = initial_observation(self._book, info.goal, task_id)
        return ResetResult(
            observation=self._observation,
            available_actions=None,
            info={"task_id": task_id, "goal": info.goal, "depth": info.depth, "split": info.split},
        )

    def observe(self) -> str:
        self._require_episode()
        return self._observation

    @property
    def inventory(self) -> dict[str, int]:
        """A copy of the current inventory (item id -> count)."""
        return dict(self._inventory)

    def step(self, action: str) -> StepResult:
        self._require_episode()
        if self._success or self._truncated:
            return self._result(EPISODE_OVER, reward=0.0, invalid=False, episode_over=True)
        self._steps += 1
        parsed = parse_action(action if isinstance(action, str) else str(action))
        reward = 0.0
        invalid = False
        if isinstance(parsed, Invalid):
            invalid = True
            observation = f"{parsed.reason} {HELP}"
        elif isinstance(parsed, Inventory):
            observation = self._describe_inventory()
        elif isinstance(parsed, Get):
            observation = self._get(Get(parsed.count, self._book.resolve(parsed.item)))
        else:
            parsed = self._resolved(parsed)
            try:
                observation = self._craft(parsed)
            except _CraftFailed as failure:
                observation = str(failure)
            else:
                if parsed.item == self._goal:
                    self._success = True
                    reward = 1.0
        if not self._success and self.max_steps is not None and self._steps >= self.max_steps:
            self._truncated = True
        self._observation = observation
        return self._result(observation, reward=reward, invalid=invalid)

    def close(self) -> None:
        self._inventory = {}

    # -- actions ------------------------------------------------------------------------------

    def _describe_inventory(self) -> str:
        if not self._inventory:
            return "Inventory: You are not carrying anything."
        listed = " ".join(f"[{display_name(item)}] ({count})" for item, count in self._inventory.items())
        return f"Inventory: {listed}"

    def _get(self, action: Get) -> str:
        book, item, name = self._book, action.item, display_name(action.item)
        if book.is_tag(item):
            return f"Could not find {name}: it names a group of items; get or craft a specific one."
        if book.is_craftable(item):
            return f"Could not find {name}: it has to be crafted; only base items can be fetched with get."
        if not book.is_item(item):
            return f"Could not find {name}: there is no such item."
        if action.count < 1:
            return f"Could not get {action.count} {name}: the amount must be at least 1."
        self._inventory[item] = self._inventory.get(item, 0) + action.count
        return f"Got {action.count} {name}"

    def _craft(self, action: Craft) -> str:
        book, output = self._book, action.item
        target = f"Could not find a valid recipe for {output}"
        if book.is_tag(output):
            raise _CraftFailed(f"{target}: {display_name(output)} names a group of items; craft a specific one.")
        recipes = book.item_recipes(output)
        if not recipes:
            reason = "it is a base item, fetch it with get" if book.is_item(output) else "there is no such item"
            raise _CraftFailed(f"{target}: {reason}.")
        zero = [name for name, count in action.ingredients if count < 1]
        if zero:
            raise _CraftFailed(f"{target}: ingredient amounts must be at least 1 ({display_name(zero[0])}).")

        chosen: tuple[Recipe, int, list[tuple[Ingredient, int]]] | None = None
        same_ingredients = False
        for recipe in recipes:
            pairing = _pair(book, recipe.ingredients, action.ingredients)
            if pairing is None:
                continue
            same_ingredients = True
            batches = _batches(pairing)
            if batches is not None:
                chosen = (recipe, batches, pairing)
                break
        if chosen is None:
            if same_ingredients:
                raise _CraftFailed(
                    f"{target}: the ingredient quantities do not match its recipe; "
                    "use the recipe's quantities or the same whole multiple of each."
                )
            listed = ", ".join(f"{count} {display_name(name)}" for name, count in action.ingredients)
            raise _CraftFailed(f"{target} using {listed}: no recipe makes it from these ingredients.")

        recipe, batches, pairing = chosen
        for name, _ in action.ingredients:
            if book.is_tag(name):
                raise _CraftFailed(
                    f"Could not find enough items to craft {output}: {display_name(name)} names a group of "
                    f"items; use a specific one, e.g. {display_name(book.members(name)[0])}."
                )
        # Take each ingredient from what it may be drawn from, on a copy: all or nothing.
        left = dict(self._inventory)
        for (name, count), (ingredient, _) in zip(action.ingredients, pairing, strict=True):
            pool = self._pool(name, ingredient)
            have = sum(left.get(item, 0) for item in pool)
            if have < count:
                raise _CraftFailed(
                    f"Could not find enough items to craft {output}: "
                    f"{count} {display_name(name)} needed, {have} in the inventory."
                )
            needed = count
            for item in pool:
                taken = min(needed, left.get(item, 0))
                if taken:
                    left[item] -= taken
                    needed -= taken
                if not needed:
                    break
        self._inventory = {item: count for item, count in left.items() if count}
        made = recipe.count * batches
        self._inventory[output] = self._inventory.get(output, 0) + made
        return f"Crafted {made} {output}"

    # -- helpers ------------------------------------------------------------------------------

    def _resolved(self, action: Craft) -> Craft:
        """`action` with each name as the recipes spell it (singular/plural), duplicates summed."""
        resolve = self._book.resolve
        ingredients: dict[str, int] = {}
        for name, count in action.ingredients:
            known = resolve(name)
            ingredients[known] = ingredients.get(known, 0) + count
        return Craft(action.count, resolve(action.item), tuple(ingredients.items()))

    def _pool(self, name: str, ingredient: Ingredient) -> list[str]:
        """The held items an ingredient written as `name` may be taken from, in order: `name` itself,
        then (for a group spelled as an item, such as oak logs) the group's other members held."""
        if ingredient.is_tag:
            return [name]  # a member of a real tag (oak planks for planks), named as such
        book = self._book
        accepted = {ingredient.name, *book.stand_ins(ingredient.name)}
        pool = dict.fromkeys([name, *book.stand_ins(name), ingredient.name])
        return [item for item in pool if item in accepted]

    def _require_episode(self) -> None:
        if self._task_id is None:
            raise EpisodeNotStartedError("reset(task_id) must be called before step/observe")

    def _result(self, observation: str, *, reward: float, invalid: bool, episode_over: bool = False) -> StepResult:
        info: dict[str, Any] = {"invalid_action": invalid, "success": self._success, "steps": self._steps}
        if episode_over:
            info["episode_over"] = True
        return StepResult(
            observation=observation,
            reward=reward,
            done=self._success,
            truncated=self._truncated,
            score=1.0 if self._success else 0.0,
            available_actions=None,
            info=info,
        )


def _pair(
    book: RecipeBook, ingredients: tuple[Ingredient, ...], given: tuple[tuple[str, int], ...]
) -> list[tuple[Ingredient, int]] | None:
    """Match each given (item, count) to a distinct recipe ingredient; None if impossible."""
    if len(ingredients) != len(given):
        return None
    used = [False] * len(ingredients)
    pairs: list[tuple[Ingredient, int]] = []

    def fits(ingredient: Ingredient, name: str) -> bool:
        if ingredient.is_tag:
            return book.matches(ingredient, name) or ingredient.name == name
        return name == ingredient.name or name in book.stand_ins(ingredient.name)

    def assign(position: int) -> bool:
        if position == len(given):
            return True
        name, count = given[position]
        for index, ingredient in enumerate(ingredients):
            if not used[index] and fits(ingredient, name):
                used[index] = True
                pairs.append((ingredient, count))
                if assign(position + 1):
                    return True
                pairs.pop()
                used[index] = False
        return False

    return pairs if assign(0) else None


def _batches(pairing: list[tuple[Ingredient, int]]) -> int | None:
    """The common whole multiple k of every ingredient's count, or None."""
    multiple: int | None = None
    for ingredient, count in pairing:
        if count % ingredient.count:
            return None
        k = count // ingredient.count
        if multiple is None:
            multiple = k
        elif k != multiple:
            return None
    return multiple
