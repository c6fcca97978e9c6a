"""The page as WebArena's agents see it: accessibility-tree lines ``[id] role 'name' props``.

Chromium's full accessibility tree (CDP ``Accessibility.getFullAXTree``) is walked depth first;
each kept node becomes one line indented by one tab per depth, e.g. (tabs shown as spaces)::

    [1] RootWebArea 'Login' focused: True
        [12] textbox 'Username' required: True
        [15] button 'Sign in'

The id is the handle that actions use (``click [15]``). Chromium's backend DOM node ids are stable
while an element lives but depend on the renderer's history (a reused context numbers on from the
pages it showed before), so the same task page printed them differently from one reset to the next
and a recorded action list could not be replayed. `ElementIds` therefore numbers an episode's
elements 1, 2, 3 ... in the order they are first printed: the same page prints the same ids, the
same actions reproduce the same episode, and an id keeps naming its element while it lives.

As in WebArena, nameless structural nodes (``generic``, ``list``, ``paragraph`` ...) are not printed (their
children move up a level), uninformative properties (``focusable``, ``editable`` ...) are dropped, and a
``StaticText`` repeating the name of one of the lines just above it (a link's own text) is skipped, to save
tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

# Properties that carry no information for an agent (or are implied by the role).
IGNORED_PROPERTIES = frozenset(
    {"focusable", "editable", "readonly", "level", "settable", "multiline", "invalid", "hiddenRoot", "url"}
)
# Roles printed only when they have a name or properties.
STRUCTURAL_ROLES = frozenset(
    {
        "generic",
        "none",
        "img",
        "list",
        "strong",
        "emphasis",
        "paragraph",
        "banner",
        "navigation",
        "Section",
        "LabelText",
        "Legend",
        "listitem",
        "group",
        "InlineTextBox",
        "LineBreak",
    }
)
# Nodes never printed (their children still are).
SKIPPED_ROLES = frozenset({"InlineTextBox", "LineBreak", "none", "presentation"})
# A StaticText is dropped when its text appeared in this many lines above it.
_DUPLICATE_WINDOW = 3


@dataclass(frozen=True)
class AXNode:
    """One printed node: its id (backend DOM node id from `build_tree`, the episode's element id once
    `ElementIds.number` has renumbered it), role, name and kept properties."""

    node_id: int
    role: str
    name: str
    properties: tuple[tuple[str, str], ...]
    depth: int

    def line(self) -> str:
        text = f"[{self.node_id}] {self.role} {_quote(self.name)}"
        if self.properties:
            text += " " + " ".join(f"{key}: {value}" for key, value in self.properties)
        return "\t" * self.depth + text


@dataclass(frozen=True)
class AXTree:
    nodes: tuple[AXNode, ...]

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(node.node_id for node in self.nodes)

    def text(self, max_chars: int | None = None) -> str:
        lines = [node.line() for node in self.nodes]
        text = "\n".join(lines)
        if max_chars is not None and len(text) > max_chars:
            cut = text.rfind("\n", 0, max_chars)
            text = text[: cut if cut > 0 else max_chars] + "\n... (page truncated; scroll or navigate to see more)"
        return text

    def find(self, node_id: int) -> AXNode | None:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        return None


def _quote(name: str) -> str:
    return repr(name)


def _value(field: Mapping[str, Any] | None) -> Any:
    if not field:
        return None
    return field.get("value")


def _format_property(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def build_tree(raw_nodes: Iterable[Mapping[str, Any]]) -> AXTree:
    """Lines from CDP's ``Accessibility.getFullAXTree`` nodes (one frame)."""
    nodes = list(raw_nodes)
    by_id = {str(node["nodeId"]): node for node in nodes}
    children_of_root = [node for node in nodes if not node.get("parentId")]
    printed: list[AXNode] = []
    recent_texts: list[str] = []

    def visit(node: Mapping[str, Any], depth: int) -> None:
        role = str(_value(node.get("role")) or "")
        name = str(_value(node.get("name")) or "").strip()
        backend_id = node.get("backendDOMNodeId")
        keep = not node.get("ignored", False) and backend_id is not None and role not in SKIPPED_ROLES
        properties: list[tuple[str, str]] = []
        if keep:
            for prop in node.get("properties", ()) or ():
                key = prop.get("name")
                value = _value(prop.get("value"))
                if key in IGNORED_PROPERTIES or value is None or value == "":
                    continue
                properties.append((str(key), _format_property(value)))
            # The current value of a form field matters (WebArena shows it as a property).
            field_value = _value(node.get("value"))
            if field_value not in (None, "") and role not in ("StaticText",):
                properties.append(("value", repr(str(field_value))))
            if not name and not properties and role in STRUCTURAL_ROLES:
                keep = False
            if role == "StaticText" and (not name or name in recent_texts[-_DUPLICATE_WINDOW:]):
                keep = False
        if keep:
            assert backend_id is not None
            printed.append(AXNode(int(backend_id), role, name, tuple(properties), depth))
            if name:
                recent_texts.append(name)
        for child_id in node.get("childIds", ()) or ():
            child = by_id.get(str(child_id))
            if child is not None:
                visit(child, depth + 1 if keep else depth)

    for root in children_of_root:
        visit(root, 0)
    return AXTree(tuple(printed))


class ElementIds:
    """One episode's element ids: 1, 2, 3 ... in the order elements are first printed, per tab.

    A backend id keeps its element id for the whole episode, so an element printed again after an action
    keeps its id, and new elements get the next numbers.
    """

    def __init__(self) -> None:
        self._element_of: dict[tuple[int, int], int] = {}
        self._backend_of: dict[int, tuple[int, int]] = {}

    def number(self, tree: AXTree, page_key: int) -> AXTree:
        """`tree` (backend ids, from one tab) with element ids."""
        nodes = []
        for node in tree.nodes:
            key = (page_key, node.node_id)
            element_id = self._element_of.get(key)
            if element_id is None:
                element_id = self._element_of[key] = len(self._element_of) + 1
                self._backend_of[element_id] = key
            nodes.append(replace(node, node_id=element_id))
        return AXTree(tuple(nodes))

    def backend_id(self, element_id: int, page_key: int) -> int | None:
        """The backend DOM node id of `element_id` when it is an element of that tab, else None."""
        key = self._backend_of.get(element_id)
        return key[1] if key is not None and key[0] == page_key else None
