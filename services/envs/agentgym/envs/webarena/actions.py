"""WebArena's action grammar, parsed into `BrowserAction` values.

::

    click [id]                 hover [id]
    type [id] [text] [0|1]     (1, the default, presses Enter after typing)
    press [keys]               (Playwright key names, e.g. Enter, Control+a, Meta+ArrowLeft)
    scroll [up|down]
    new_tab   tab_focus [n]   close_tab
    goto [url]   go_back   go_forward
    stop [answer]              (ends the episode; the answer is what string evaluators grade)

Parsing is strict about the shape and forgiving about surrounding whitespace and a wrapping pair
of backticks (models often emit ```click [12]```). Anything else raises `ActionParseError`, whose
message says what was wrong and shows the grammar: the environment returns it as the observation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ActionKind = Literal[
    "click",
    "type",
    "hover",
    "press",
    "scroll",
    "new_tab",
    "tab_focus",
    "close_tab",
    "goto",
    "go_back",
    "go_forward",
    "stop",
]

GRAMMAR = (
    "Valid actions: click [id], type [id] [text] [0|1], hover [id], press [keys], scroll [up|down], "
    "new_tab, tab_focus [tab index], close_tab, goto [url], go_back, go_forward, stop [answer]."
)


class ActionParseError(ValueError):
    """The action does not follow the grammar; the message says why."""


@dataclass(frozen=True)
class BrowserAction:
    kind: ActionKind
    element_id: int | None = None
    text: str = ""
    press_enter: bool = False
    keys: str = ""
    direction: Literal["up", "down"] = "down"
    tab_index: int = 0
    url: str = ""
    answer: str = ""

    def __str__(self) -> str:
        match self.kind:
            case "click" | "hover":
                return f"{self.kind} [{self.element_id}]"
            case "type":
                return f"type [{self.element_id}] [{self.text}] [{int(self.press_enter)}]"
            case "press":
                return f"press [{self.keys}]"
            case "scroll":
                return f"scroll [{self.direction}]"
            case "tab_focus":
                return f"tab_focus [{self.tab_index}]"
            case "goto":
                return f"goto [{self.url}]"
            case "stop":
                return f"stop [{self.answer}]"
            case _:
                return self.kind


_ID = re.compile(r"^(click|hover)\s*\[\s*(\d+)\s*\]$", re.IGNORECASE)
_TYPE_WITH_FLAG = re.compile(r"^type\s*\[\s*(\d+)\s*\]\s*\[(.*)\]\s*\[\s*([01])\s*\]$", re.IGNORECASE | re.DOTALL)
_TYPE = re.compile(r"^type\s*\[\s*(\d+)\s*\]\s*\[(.*)\]$", re.IGNORECASE | re.DOTALL)
_BRACKETED = re.compile(r"^(press|scroll|tab_focus|goto|stop)\s*\[(.*)\]$", re.IGNORECASE | re.DOTALL)
_BARE = frozenset({"new_tab", "close_tab", "go_back", "go_forward", "stop"})


def parse_action(text: str) -> BrowserAction:
    """One action from the agent's text; raises ActionParseError with the reason."""
    action = text.strip()
    if len(action) >= 2 and action.startswith("`") and action.endswith("`"):
        action = action.strip("`").strip()
    if not action:
        raise ActionParseError(f"The action is empty. {GRAMMAR}")
    if action.lower() in _BARE:
        kind = action.lower()
        return BrowserAction(kind=kind)  # type: ignore[arg-type]
    if match := _ID.match(action):
        return BrowserAction(kind=match[1].lower(), element_id=int(match[2]))  # type: ignore[arg-type]
    if match := _TYPE_WITH_FLAG.match(action):
        return BrowserAction(kind="type", element_id=int(match[1]), text=match[2], press_enter=match[3] == "1")
    if match := _TYPE.match(action):
        return BrowserAction(kind="type", element_id=int(match[1]), text=match[2], press_enter=True)
    if match := _BRACKETED.match(action):
        kind, argument = match[1].lower(), match[2].strip()
        if kind == "press":
            if not argument:
                raise ActionParseError(f"press needs keys, e.g. press [Enter]. {GRAMMAR}")
            return BrowserAction(kind="press", keys=argument)
        if kind == "scroll":
            direction = argument.lower().removeprefix("direction=")
            if direction not in ("up", "down"):
                raise ActionParseError(f"scroll takes [up] or [down], not [{argument}]. {GRAMMAR}")
            return BrowserAction(kind="scroll", direction=direction)  # type: ignore[arg-type]
        if kind == "tab_focus":
            if not argument.isdigit():
                raise ActionParseError(f"tab_focus takes a tab index, e.g. tab_focus [0], not [{argument}].")
            return BrowserAction(kind="tab_focus", tab_index=int(argument))
        if kind == "goto":
            if not argument:
                raise ActionParseError("goto needs a URL, e.g. goto [http://example.com/page].")
            return BrowserAction(kind="goto", url=argument)
        return BrowserAction(kind="stop", answer=argument)
    words = action.split("[", 1)[0].split()  # none when the reply starts with a bracket, e.g. "[12] Submit"
    verb = words[0].lower() if words else ""
    if verb in ("click", "hover", "type"):
        raise ActionParseError(
            f"Could not parse {action!r}: {verb} needs an element id from the page in brackets, "
            f"e.g. {verb} [12]{' [text] [0]' if verb == 'type' else ''}. {GRAMMAR}"
        )
    raise ActionParseError(f"Unknown action {action!r}. {GRAMMAR}")
