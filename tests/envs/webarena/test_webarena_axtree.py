"""Accessibility-tree rendering from CDP nodes, checked line by line on a hand-made tree."""

from __future__ import annotations

from typing import Any

from agentgym.envs.webarena.axtree import AXNode, AXTree, ElementIds, build_tree


def node(
    node_id: int,
    role: str,
    name: str = "",
    children: tuple[int, ...] = (),
    parent: int | None = None,
    ignored: bool = False,
    properties: dict[str, Any] | None = None,
    value: str | None = None,
) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "nodeId": str(node_id),
        "backendDOMNodeId": node_id,
        "role": {"type": "role", "value": role},
        "name": {"type": "computedString", "value": name},
        "childIds": [str(child) for child in children],
        "ignored": ignored,
        "properties": [{"name": k, "value": {"type": "x", "value": v}} for k, v in (properties or {}).items()],
    }
    if parent is not None:
        raw["parentId"] = str(parent)
    if value is not None:
        raw["value"] = {"type": "string", "value": value}
    return raw


def test_tree_lines_indentation_and_pruning() -> None:
    nodes = [
        node(1, "RootWebArea", "Shop", (2,), properties={"focused": True, "url": "http://x"}),
        node(2, "generic", "", (3, 4, 7, 9), parent=1),  # nameless structure: not printed
        node(3, "heading", "Orders", (5,), parent=2, properties={"level": 1}),
        node(5, "StaticText", "Orders", (), parent=3),  # repeats its heading: dropped
        node(4, "link", "Order #12", (6,), parent=2),
        node(6, "StaticText", "Order #12", (), parent=4),
        node(7, "textbox", "Search", (), parent=2, properties={"focusable": True, "required": False}, value="shoes"),
        node(9, "checkbox", "Gift", (10,), parent=2, properties={"checked": "true"}),
        node(10, "none", "", (11,), parent=9, ignored=True),
        node(11, "StaticText", "wrap it", (), parent=10),
    ]
    tree = build_tree(nodes)
    assert tree.text().splitlines() == [
        "[1] RootWebArea 'Shop' focused: True",
        "\t[3] heading 'Orders'",
        "\t[4] link 'Order #12'",
        "\t[7] textbox 'Search' required: False value: 'shoes'",
        "\t[9] checkbox 'Gift' checked: true",
        "\t\t[11] StaticText 'wrap it'",
    ]
    assert tree.ids == frozenset({1, 3, 4, 7, 9, 11})


def test_names_with_quotes_are_escaped_and_long_pages_truncated() -> None:
    nodes = [node(1, "RootWebArea", "Q", (2, 3), properties={}), node(2, "button", "it's", parent=1)]
    nodes += [node(3, "list", "", tuple(range(10, 60)), parent=1)]
    nodes += [node(i, "listitem", f"item {i}", parent=3) for i in range(10, 60)]
    tree = build_tree(nodes)
    assert '[2] button "it\'s"' in tree.text()
    short = tree.text(max_chars=200)
    assert len(short) < 300 and short.endswith("(page truncated; scroll or navigate to see more)")


def backend_tree(*backend_ids: int) -> AXTree:
    """Buttons named by their position, with the given backend ids."""
    return AXTree(tuple(AXNode(b, "button", f"b{i}", (), 0) for i, b in enumerate(backend_ids)))


def test_element_ids_number_an_episode_in_order_of_first_sight_per_tab() -> None:
    ids = ElementIds()
    first = ids.number(backend_tree(907, 15, 330), page_key=1)
    assert [n.node_id for n in first.nodes] == [1, 2, 3]
    assert first.text() == "[1] button 'b0'\n[2] button 'b1'\n[3] button 'b2'"  # only the ids change
    # After an action: 15 is gone, 330 and 907 keep their ids, the new elements get the next numbers.
    second = ids.number(backend_tree(330, 41, 907, 52), page_key=1)
    assert [n.node_id for n in second.nodes] == [3, 4, 1, 5]
    # Another tab's backend ids are other elements, even where the numbers are equal.
    other_tab = ids.number(backend_tree(907), page_key=2)
    assert [n.node_id for n in other_tab.nodes] == [6]
    assert ids.backend_id(1, page_key=1) == 907 and ids.backend_id(5, page_key=1) == 52
    assert ids.backend_id(6, page_key=1) is None  # an element of the other tab
    assert ids.backend_id(6, page_key=2) == 907
    assert ids.backend_id(99, page_key=1) is None
    # The same page in a new episode prints the same ids, whatever backend ids the renderer gave it.
    assert ElementIds().number(backend_tree(5001, 4002, 3003), page_key=7).text() == first.text()
