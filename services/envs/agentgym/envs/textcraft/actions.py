"""Parsing of TextCraft's bare actions: ``get N item``, ``craft N item using M a, K b``, ``inventory``.

Parsing is lenient about form (case, extra spaces, a trailing full stop, ``minecraft:`` prefixes,
underscores) but not about content: item names are the recipes' names (``oak logs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentgym.envs.textcraft.recipes import item_id

COMMAND_FORMATS = "get N item | craft N item using M ingredient, K ingredient | inventory"
HELP = (
    "Valid commands are: 'get N item' (base items only, e.g. get 2 oak logs), "
    "'craft N item using M ingredient, K ingredient' (e.g. craft 4 stick using 2 oak planks) "
    "and 'inventory'."
)

_GET = re.compile(r"get\s+(\d+)\s+(\S.*)")
_CRAFT = re.compile(r"craft\s+(\S.*?)\s+using\s+(\S.*)")
_COUNTED = re.compile(r"(\d+)\s+(\S.*)")
_INVENTORY = re.compile(r"inventory|check inventory|show inventory")


@dataclass(frozen=True, slots=True)
class Get:
    count: int
    item: str  # item id, e.g. minecraft:oak_logs


@dataclass(frozen=True, slots=True)
class Craft:
    count: int | None  # as written; the crafted amount follows from the ingredients
    item: str
    ingredients: tuple[tuple[str, int], ...]  # (item id, count), duplicates summed, in order


@dataclass(frozen=True, slots=True)
class Inventory:
    pass


@dataclass(frozen=True, slots=True)
class Invalid:
    reason: str


Action = Get | Craft | Inventory | Invalid


def _normalise(text: str) -> str:
    text = " ".join(text.strip().split()).lower()
    return text.rstrip(".").rstrip()


def parse_action(text: str) -> Action:
    """Parse one bare action. Never raises: unparsable text gives `Invalid`."""
    action = _normalise(text)
    if not action:
        return Invalid("Empty action.")
    if _INVENTORY.fullmatch(action):
        return Inventory()
    match = _GET.fullmatch(action)
    if match:
        return Get(int(match.group(1)), item_id(match.group(2)))
    match = _CRAFT.fullmatch(action)
    if match:
        return _parse_craft(match.group(1), match.group(2))
    return Invalid(f"Could not execute {text.strip()!r}.")


def _parse_craft(output_text: str, inputs_text: str) -> Action:
    counted = _COUNTED.fullmatch(output_text)
    count: int | None
    if counted:
        count, output = int(counted.group(1)), item_id(counted.group(2))
    else:
        count, output = None, item_id(output_text)
    ingredients: dict[str, int] = {}
    for part in inputs_text.split(","):
        part = part.strip()
        if part.startswith("and "):
            part = part[4:].strip()
        counted = _COUNTED.fullmatch(part)
        if not counted:
            return Invalid(f"Wrong item format: {part!r}; each ingredient is written 'N item', e.g. '2 oak planks'.")
        name = item_id(counted.group(2))
        ingredients[name] = ingredients.get(name, 0) + int(counted.group(1))
    return Craft(count, output, tuple(ingredients.items()))
