"""TextCraftExpert: its demonstrations solve every goal when replayed on a fresh environment."""

from __future__ import annotations

import re

import pytest

import agentgym.envs
from agentgym.envs.textcraft.env import TextCraftEnv
from agentgym.envs.textcraft.expert import TextCraftExpert

_CRAFT = re.compile(r"craft (\d+) (.+) using (.+)")


def replay(task_id: str, actions: list[str]) -> tuple[bool, int]:
    env = TextCraftEnv()
    reset = env.reset(task_id)
    listed = reset.observation.split("\n\n")[0].splitlines()[1:]
    result = None
    for step, action in enumerate(actions):
        assert not (result is not None and result.done), f"{task_id}: solved before its last action"
        result = env.step(action)
        assert result.info["invalid_action"] is False, (task_id, action, result.observation)
        assert not result.observation.startswith("Could"), (task_id, action, result.observation)
        if action.startswith("craft "):
            assert _uses_listed_recipe(action, listed), (task_id, action)
        if step < len(actions) - 1:
            assert result.reward == 0.0
    assert result is not None
    return bool(result.done and result.reward == 1.0 and result.info["success"]), len(actions)


def _uses_listed_recipe(action: str, listed: list[str]) -> bool:
    """The craft is a whole multiple of one of the recipes shown in the observation."""
    match = _CRAFT.fullmatch(action)
    assert match
    count, item = int(match.group(1)), match.group(2)
    given = [part.split(" ", 1) for part in match.group(3).split(", ")]
    for line in listed:
        shown = _CRAFT.fullmatch(line)
        assert shown
        if shown.group(2) != item:
            continue
        needs = [part.split(" ", 1) for part in shown.group(3).split(", ")]
        if len(needs) != len(given) or count % int(shown.group(1)):
            continue
        k = count // int(shown.group(1))
        pairs = zip(given, needs, strict=True)
        if all(int(g[0]) == k * int(n[0]) and (g[1] == n[1] or _is_member(g[1], n[1])) for g, n in pairs):
            return True
    return False


def _is_member(item: str, tag: str) -> bool:
    book = TextCraftEnv.catalog().book
    return book.tag_of("minecraft:" + item.replace(" ", "_")) == "minecraft:" + tag.replace(" ", "_")


def test_expert_from_registry() -> None:
    expert = agentgym.envs.make_expert("textcraft")
    assert isinstance(expert, TextCraftExpert)
    assert expert.demonstrate("craft/minecraft:oak_planks") == [
        "get 1 oak logs",
        "craft 4 oak planks using 1 oak logs",
    ]


def test_expert_reuses_leftovers_and_batches() -> None:
    actions = TextCraftExpert().demonstrate("craft/minecraft:dark_oak_sign")
    assert actions[-1] == "craft 3 dark oak sign using 6 dark oak planks, 1 stick"
    assert "craft 8 dark oak planks using 2 dark oak logs" in actions
    single = TextCraftExpert(batch=False).demonstrate("craft/minecraft:dark_oak_sign")
    assert single.count("craft 4 dark oak planks using 1 dark oak logs") == 2
    assert replay("craft/minecraft:dark_oak_sign", single)[0]


def test_expert_is_deterministic() -> None:
    ids = TextCraftEnv.catalog().task_ids("test")[:10]
    assert [TextCraftExpert().demonstrate(t) for t in ids] == [TextCraftExpert().demonstrate(t) for t in ids]


@pytest.mark.parametrize("split", ["test"])
def test_expert_solves_a_sample(split: str) -> None:
    ids = TextCraftEnv.catalog().task_ids(split)
    for task_id in ids[::7]:
        assert replay(task_id, TextCraftExpert().demonstrate(task_id))[0], task_id


@pytest.mark.parametrize("batch", [True, False])
def test_expert_solves_every_goal(batch: bool) -> None:
    expert = TextCraftExpert(batch=batch)
    ids = TextCraftEnv.catalog().task_ids("all")
    solved = [task_id for task_id in ids if replay(task_id, expert.demonstrate(task_id))[0]]
    assert len(solved) == len(ids) == 544
