"""WebArena's action grammar: every action kind parses; malformed ones say what was wrong."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentgym.envs.webarena.actions import ActionParseError, BrowserAction, parse_action


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("click [12]", BrowserAction("click", element_id=12)),
        ("  CLICK [ 7 ]  ", BrowserAction("click", element_id=7)),
        ("```click [12]```", BrowserAction("click", element_id=12)),
        ("hover [3]", BrowserAction("hover", element_id=3)),
        ("type [5] [hello world] [0]", BrowserAction("type", element_id=5, text="hello world", press_enter=False)),
        ("type [5] [hello]", BrowserAction("type", element_id=5, text="hello", press_enter=True)),
        ("type [5] [a [1] b] [1]", BrowserAction("type", element_id=5, text="a [1] b", press_enter=True)),
        ("type [5] []", BrowserAction("type", element_id=5, text="", press_enter=True)),
        ("press [Control+a]", BrowserAction("press", keys="Control+a")),
        ("scroll [down]", BrowserAction("scroll", direction="down")),
        ("scroll [direction=up]", BrowserAction("scroll", direction="up")),
        ("new_tab", BrowserAction("new_tab")),
        ("tab_focus [2]", BrowserAction("tab_focus", tab_index=2)),
        ("close_tab", BrowserAction("close_tab")),
        ("goto [http://localhost:7770/a?b=1]", BrowserAction("goto", url="http://localhost:7770/a?b=1")),
        ("go_back", BrowserAction("go_back")),
        ("go_forward", BrowserAction("go_forward")),
        ("stop [$25.99]", BrowserAction("stop", answer="$25.99")),
        ("stop []", BrowserAction("stop", answer="")),
        ("stop", BrowserAction("stop", answer="")),
    ],
)
def test_parses(text: str, expected: BrowserAction) -> None:
    assert parse_action(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("click", "needs an element id"),
        ("click [submit]", "needs an element id"),
        ("type [4]", "needs an element id"),
        ("scroll [left]", "[up] or [down]"),
        ("tab_focus [first]", "tab index"),
        ("goto []", "needs a URL"),
        ("press []", "needs keys"),
        ("fly [3]", "Unknown action"),
        ("[12] Submit", "Unknown action"),  # no verb before the bracket (a tiny policy's reply; was an IndexError)
        ("  [", "Unknown action"),
    ],
)
def test_malformed_actions_say_why(text: str, fragment: str) -> None:
    with pytest.raises(ActionParseError) as raised:
        parse_action(text)
    assert fragment in str(raised.value)
    assert "Valid actions" in str(raised.value) or fragment in ("tab index", "needs a URL")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("[]` \n\tclicktype0123 stopgoto_")), max_size=40) | st.text(max_size=40))
def test_any_text_parses_or_says_why(text: str) -> None:
    # A reply is the policy's free text: anything but ActionParseError would fail the episode as an
    # environment error instead of telling the agent what is valid.
    with contextlib.suppress(ActionParseError):
        parse_action(text)


def test_round_trip_through_str() -> None:
    for text in ("click [1]", "type [2] [x y] [0]", "press [Enter]", "scroll [up]", "tab_focus [1]", "stop [42]"):
        assert str(parse_action(text)) == text


COT_REPLY = (
    "Let's think step-by-step. This page lists the products; the objective is to open the first one, "
    "whose link has id [23]. In summary, the next action I will perform is ```click [23]```"
)


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        (COT_REPLY, "click [23]"),
        # AgentGym's server takes the first fenced span, across lines, stripped
        ("I could ```scroll [down]``` but rather\n```\ntype [5] [hello] [1]\n```", "scroll [down]"),
        ("Thinking.\n```\ntype [5] [hello] [1]\n```", "type [5] [hello] [1]"),
        # without one the reply is taken whole: a bare action from our own clients
        ("click [12]", "click [12]"),
        ("```click [12]", "```click [12]"),
    ],
)
def test_agentgym_compat_extracts_the_action_from_a_whole_reply(reply: str, action: str) -> None:
    from agentgym.envs.webarena.compat import extract_action

    assert extract_action(reply) == action
    assert parse_action(extract_action(COT_REPLY)) == BrowserAction("click", element_id=23)
