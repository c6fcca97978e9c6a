"""Action parsing per environment format: the bare action, or a message saying what was expected."""

from __future__ import annotations

import pytest

from agentgym.rollout.parsing import parse_action
from agentgym.rollout.prompts import TEMPLATES, template_for


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Thought: the ball is ahead.\nAction: move forward", "move forward"),
        ("Thought: x\nAction: go to red ball 1.", "go to red ball 1"),
        ("Thought: x\n**Action:** `pick up red key 1`", "pick up red key 1"),
        ("Thought: the action: turn left is wrong\nAction: turn right", "turn right"),  # only lines that start so
        (
            "thought: lowercase works\naction:  craft 4 oak planks using 1 oak logs  ",
            "craft 4 oak planks using 1 oak logs",
        ),
        ('Thought: quote\nAction: "inventory"', "inventory"),
    ],
)
def test_thought_action(text: str, expected: str) -> None:
    assert parse_action("thought_action", text).action == expected


@pytest.mark.parametrize("text", ["I will move forward.", "Thought: hmm\nAction:", "Action: ."])
def test_thought_action_missing(text: str) -> None:
    parsed = parse_action("thought_action", text)
    assert parsed.action is None and parsed.error is not None and "Action: <one action>" in parsed.error


@pytest.mark.parametrize(
    "text",
    [
        "Action: turn left\nThought: no wait\nAction: turn right",
        "Thought: x\nAction: turn left.\nAction: turn left",
        "Thought: x\nAction: go to red ball 1\n**Action:** `turn right`",
    ],
)
def test_thought_action_refuses_several_actions(text: str) -> None:
    parsed = parse_action("thought_action", text)
    assert parsed.action is None and parsed.error is not None
    assert parsed.error.startswith('Found 2 "Action:" lines; give exactly one.')
    assert "Action: <one action>" in parsed.error


def test_search_tags() -> None:
    assert parse_action("search_tags", "Let me look. <search> capital of France </search>").action == (
        "<search>capital of France</search>"
    )
    assert parse_action("search_tags", "<ANSWER>Paris</ANSWER> done").action == "<answer>Paris</answer>"
    first = parse_action("search_tags", "<search>a</search> then <answer>b</answer>")
    assert first.action == "<search>a</search>"
    missing = parse_action("search_tags", "The answer is Paris.")
    assert missing.action is None and "<answer>" in (missing.error or "")


def test_fenced() -> None:
    assert parse_action("fenced", "Click the button.\n```click [12]```").action == "click [12]"
    assert parse_action("fenced", "```\ntype [3] [hello] [1]\n```").action == "type [3] [hello] [1]"
    two = parse_action("fenced", "```click [1]``` or ```click [2]```")
    assert two.action is None and "Found 2" in (two.error or "")
    none = parse_action("fenced", "click [1]")
    assert none.action is None and "Found no" in (none.error or "")


def test_every_environment_has_a_template_with_its_format() -> None:
    assert set(TEMPLATES) == {"babyai", "textcraft", "sciworld", "deepsearch", "webarena"}
    messages = template_for("babyai").first_messages("You see a red ball.")
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert "Action:" in messages[0]["content"] and messages[2]["content"] == "You see a red ball."
    assert template_for("deepsearch").action_format == "search_tags"
    with pytest.raises(ValueError, match="no prompt template"):
        template_for("chess")
