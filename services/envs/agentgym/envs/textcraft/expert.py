"""A scripted TextCraft solver: plans from the recipe tree, returns the bare actions.

For each item it needs it picks the shallowest recipe (ties: the first in file order) among those
listed in the task's crafting commands, resolves a tag ingredient (``planks``) to the shallowest
member it can make (preferring one it already holds), fetches base items in exactly the amounts
needed and crafts bottom-up, reusing leftovers. With ``batch=True`` (default) a recipe run k times
is one command with k times the quantities (``craft 8 oak planks using 2 oak logs``); with
``batch=False`` each run is its own command, which the original ADaPT/AgentGym environment also
accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentgym.envs.textcraft.recipes import Ingredient, Recipe, RecipeBook, display_name
from agentgym.envs.textcraft.tasks import TextCraftCatalog, load_catalog, needed_recipes


class PlanningError(RuntimeError):
    """The goal cannot be planned (never expected for catalog goals)."""


@dataclass
class _Plan:
    book: RecipeBook
    allowed: frozenset[Recipe]
    batch: bool
    actions: list[str] = field(default_factory=list)
    inventory: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    costs: dict[str, int] = field(default_factory=dict)

    def free(self, item: str) -> int:
        return self.inventory.get(item, 0) - self.reserved.get(item, 0)

    def recipes(self, item: str) -> list[Recipe]:
        return [recipe for recipe in self.book.item_recipes(item) if recipe in self.allowed]

    def cost(self, name: str, visiting: frozenset[str] = frozenset()) -> int:
        """Planning depth of an item (0: base) or tag (its cheapest member); large if impossible."""
        if name in self.costs:
            return self.costs[name]
        if name in visiting:
            return 10**6
        inner = visiting | {name}
        if self.book.is_tag(name):
            members = self.book.members(name)
            best = min((self.cost(member, inner) for member in members), default=10**6)
        elif self.book.is_base(name):
            best = 0
        else:
            best = min(
                (
                    1 + max(self.cost(ingredient.name, inner) for ingredient in recipe.ingredients)
                    for recipe in self.recipes(name)
                ),
                default=10**6,
            )
        self.costs[name] = best  # the recipe graph is acyclic, so every value is final
        return best

    def resolve(self, ingredient: Ingredient, amount: int) -> str:
        if not ingredient.is_tag:
            return ingredient.name
        members = self.book.members(ingredient.name)
        if not members:
            raise PlanningError(f"tag {ingredient.name} has no members")
        held = [member for member in members if self.free(member) >= amount]
        if held:
            return held[0]
        return min(members, key=lambda member: (self.cost(member), members.index(member)))

    def ensure(self, item: str, amount: int, depth: int = 0) -> None:
        """Act so that at least `amount` of `item` is held and not reserved."""
        if depth > 64:
            raise PlanningError(f"plan too deep at {item}")
        missing = amount - self.free(item)
        if missing <= 0:
            return
        if self.book.is_base(item):
            self.actions.append(f"get {missing} {display_name(item)}")
            self.inventory[item] = self.inventory.get(item, 0) + missing
            return
        options = self.recipes(item)
        if not options:
            raise PlanningError(f"no usable recipe for {item}")
        recipe = min(
            options,
            key=lambda r: (
                1 + max(self.cost(i.name) for i in r.ingredients),
                options.index(r),
            ),
        )
        runs = -(-missing // recipe.count)
        concrete = [(self.resolve(ing, ing.count * runs), ing.count * runs) for ing in recipe.ingredients]
        for name, count in concrete:
            self.ensure(name, count, depth + 1)
            self.reserved[name] = self.reserved.get(name, 0) + count
        for name, count in concrete:
            self.reserved[name] -= count
            self.inventory[name] -= count
        groups = [(runs, 1)] if self.batch else [(1, runs)]
        for per_command, repeats in groups:
            inputs = ", ".join(
                f"{ing.count * per_command} {display_name(name)}"
                for ing, (name, _) in zip(recipe.ingredients, concrete, strict=True)
            )
            command = f"craft {recipe.count * per_command} {display_name(item)} using {inputs}"
            self.actions.extend([command] * repeats)
        self.inventory[item] = self.inventory.get(item, 0) + recipe.count * runs


class TextCraftExpert:
    """`demonstrate(task_id)` -> the gets and crafts that make the task's goal."""

    def __init__(self, batch: bool = True) -> None:
        self.batch = batch
        self._catalog: TextCraftCatalog = load_catalog()

    def plan(self, goal: str) -> list[str]:
        """Actions that craft one `goal` item from an empty inventory."""
        book = self._catalog.book
        plan = _Plan(book=book, allowed=frozenset(needed_recipes(book, goal)), batch=self.batch)
        plan.ensure(goal, 1)
        return plan.actions

    def demonstrate(self, task_id: str) -> list[str]:
        return self.plan(self._catalog.info(task_id).goal)
