"""MiniWoB++ tasks, offline: the `miniwob` wheel's HTML served on loopback, graded by its own script.

Each task page generates a problem from a seed (``Math.seedrandom``), shows an utterance (the
objective, e.g. ``Click on the "Okay" button.``) and grades the episode in JavaScript
(``core.endEpisode(reward)``). The environment opens the page, seeds it, lifts the task's 10 s time
limit (an LLM takes longer per action than a person; the agent's turn horizon bounds episodes
instead), hides the score board, and reads the raw reward back after each action: 1 solved,
-1 wrong (reported as 0, with ``info["raw_reward"]``), fractions for partial credit.

`CURATED_TASKS` are the tasks an agent can solve with accessibility-tree actions only: no
dragging, drawing, canvas/SVG shapes, pixel coordinates, native pop-ups or reading images.
`SOLVERS` are scripted solvers for some of them: they read only the observation the agent reads
(the objective and the tree lines) and answer one action at a time, through the public API.

Task ids are ``miniwob/<task>/<seed>``; split ``train`` uses seeds 0.., ``test`` seeds from
1,000,000, interleaving the curated tasks (index i is task i mod n). The views ``train-solvable`` and
``test-solvable`` (`SPLIT_VIEWS`) hold only the tasks with a scripted solver, interleaved the same way, for
recipes that warm-start from the solvers' demonstrations; their tasks keep their ids and base split.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.resources
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgym.envs.base import UnknownTaskError

CURATED_TASKS: tuple[str, ...] = (
    "click-button",
    "click-button-sequence",
    "click-checkboxes",
    "click-checkboxes-large",
    "click-checkboxes-soft",
    "click-checkboxes-transfer",
    "click-collapsible",
    "click-collapsible-2",
    "click-dialog",
    "click-dialog-2",
    "click-link",
    "click-option",
    "click-tab",
    "click-tab-2",
    "click-tab-2-hard",
    "click-test",
    "click-test-2",
    "click-widget",
    "email-inbox",
    "email-inbox-forward-nl",
    "enter-password",
    "enter-text",
    "enter-text-2",
    "enter-text-dynamic",
    "find-word",
    "focus-text",
    "focus-text-2",
    "login-user",
    "login-user-popup",
    "multi-layouts",
    "multi-orderings",
    "navigate-tree",
    "read-table",
    "search-engine",
    "simple-arithmetic",
    "social-media",
    "social-media-all",
    "social-media-some",
    "terminal",
    "use-autocomplete",
)
SEEDS_PER_TASK = {"train": 1_000, "test": 100}
SEED_OFFSET = {"train": 0, "test": 1_000_000}
# Seeds the page, lifts the time limit, hides the score board and starts the episode.
START_JS = """([seed]) => {
  Math.seedrandom(seed);
  core.EPISODE_MAX_TIME = 24 * 3600 * 1000;
  core.startEpisodeReal();
  core.clearTimer();
  for (const id of ['reward-display', 'click-canvas']) {
    const element = document.getElementById(id);
    if (element) element.style.display = 'none';
  }
  return WOB_TASK_READY;
}"""
STATE_JS = """() => ({done: WOB_DONE_GLOBAL, raw_reward: WOB_RAW_REWARD_GLOBAL, reason: WOB_REWARD_REASON,
  ready: WOB_TASK_READY, utterance: core.getUtterance()})"""


@dataclass(frozen=True)
class MiniWoBTask:
    name: str
    seed: int

    @property
    def task_id(self) -> str:
        return f"miniwob/{self.name}/{self.seed}"

    def path(self) -> str:
        return f"/miniwob/{self.name}.html"


def parse_task_id(task_id: str) -> MiniWoBTask:
    parts = task_id.split("/")
    if len(parts) != 3 or parts[0] != "miniwob" or not parts[2].isdigit():
        raise UnknownTaskError(f"unknown task {task_id!r}; MiniWoB task ids look like miniwob/click-button/7")
    if parts[1] not in CURATED_TASKS:
        raise UnknownTaskError(f"unknown MiniWoB task {parts[1]!r}; tasks are {', '.join(CURATED_TASKS)}")
    return MiniWoBTask(parts[1], int(parts[2]))


def task_for(split: str, index: int) -> MiniWoBTask:
    """The `index`-th task of `split` (``train``, ``test``, or a view such as ``train-solvable``): the split's
    tasks interleaved, task i mod n with the split's seed offset + i div n."""
    base, _, view = split.partition("-")
    names = split_tasks(view)
    return MiniWoBTask(names[index % len(names)], SEED_OFFSET[base] + index // len(names))


def split_of(task: MiniWoBTask) -> str:
    return "test" if task.seed >= SEED_OFFSET["test"] else "train"


# -- the loopback task server ---------------------------------------------------------------------


def html_root() -> Path:
    """The wheel's ``html`` folder (``miniwob/``, ``core/``, ``common/`` ...)."""
    return Path(str(importlib.resources.files("miniwob") / "html"))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return


class TaskServer:
    """The MiniWoB++ pages over HTTP on 127.0.0.1 (a random free port), in a daemon thread."""

    def __init__(self, root: Path | None = None, host: str = "127.0.0.1") -> None:
        handler = functools.partial(_QuietHandler, directory=str(root or html_root()))
        self._server = http.server.ThreadingHTTPServer((host, 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="miniwob-http", daemon=True)
        self._thread.start()

    @property
    def origin(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def url(self, task: MiniWoBTask) -> str:
        return self.origin + task.path()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._server.shutdown()
            self._server.server_close()


_server: TaskServer | None = None
_server_lock = threading.Lock()


def shared_task_server() -> TaskServer:
    global _server
    with _server_lock:
        if _server is None:
            _server = TaskServer()
        return _server


# -- scripted solvers ---------------------------------------------------------------------------------

_LINE = re.compile(r"^\s*\[(\d+)\] (\S+) '((?:[^'\\]|\\.)*)'(.*)$")


@dataclass(frozen=True)
class Line:
    node_id: int
    role: str
    name: str
    rest: str


def tree_lines(observation: str) -> list[Line]:
    """The ``[id] role 'name' props`` lines of an observation (names with plain quoting)."""
    lines = []
    for text in observation.splitlines():
        if match := _LINE.match(text):
            lines.append(Line(int(match[1]), match[2], match[3].replace("\\'", "'"), match[4]))
    return lines


def _find(lines: list[Line], roles: tuple[str, ...], name: str | None = None) -> Line | None:
    for line in lines:
        if line.role in roles and (name is None or line.name.strip().lower() == name.strip().lower()):
            return line
    return None


def _quoted(objective: str) -> list[str]:
    return re.findall(r'"([^"]*)"', objective)


def _submit(lines: list[Line], label: str = "submit") -> str:
    button = _find(lines, ("button",), label)
    if button is None:
        raise LookupError(f"no {label!r} button on the page")
    return f"click [{button.node_id}]"


def solve_click_button(objective: str, observation: str, history: list[str]) -> str:
    """``Click on the "X" button.`` -> click the button named X."""
    (label,) = _quoted(objective)
    return _submit(tree_lines(observation), label)


def solve_click_link(objective: str, observation: str, history: list[str]) -> str:
    """``Click on the link "X".`` -> click the link named X (MiniWoB's links are styled text)."""
    (label,) = _quoted(objective)
    lines = [line for line in tree_lines(observation) if not line.name.startswith("Click on the link")]
    link = _find(lines, ("link",), label) or _find(lines, ("StaticText",), label)
    if link is None:
        raise LookupError(f"no link {label!r}")
    return f"click [{link.node_id}]"


def solve_click_checkboxes(objective: str, observation: str, history: list[str]) -> str:
    """``Select a, b and click Submit.`` -> check exactly those boxes, then submit."""
    match = re.match(r"Select (.*) and click Submit\.", objective)
    if match is None:
        raise LookupError(f"unexpected objective {objective!r}")
    wanted = {word.strip().lower() for word in re.split(r",\s*", match[1]) if word.strip()}
    if wanted == {"nothing"}:
        wanted = set()
    lines = tree_lines(observation)
    for line in lines:
        if line.role == "checkbox":
            checked = "checked: true" in line.rest.lower()
            if (line.name.strip().lower() in wanted) != checked:
                return f"click [{line.node_id}]"
    return _submit(lines)


def solve_enter_text(objective: str, observation: str, history: list[str]) -> str:
    """``Enter "X" into the text field and press Submit.`` -> type X, then submit."""
    (text,) = _quoted(objective)
    lines = tree_lines(observation)
    if not any(action.startswith("type") for action in history):
        field = _find(lines, ("textbox",))
        if field is None:
            raise LookupError("no text field")
        return f"type [{field.node_id}] [{text}] [0]"
    return _submit(lines)


def solve_enter_password(objective: str, observation: str, history: list[str]) -> str:
    """``Enter the password "X" into both text fields and press submit.``"""
    (password,) = _quoted(objective)
    lines = tree_lines(observation)
    fields = [line for line in lines if line.role == "textbox"]
    typed = sum(action.startswith("type") for action in history)
    if typed < len(fields):
        return f"type [{fields[typed].node_id}] [{password}] [0]"
    return _submit(lines)


def solve_login_user(objective: str, observation: str, history: list[str]) -> str:
    """``Enter the username "U" and the password "P" into the text fields and press login.``"""
    username, password = _quoted(objective)
    lines = tree_lines(observation)
    fields = [line for line in lines if line.role == "textbox"]
    typed = sum(action.startswith("type") for action in history)
    if typed < 2:
        return f"type [{fields[typed].node_id}] [{(username, password)[typed]}] [0]"
    return _submit(lines, "login")


def solve_focus_text(objective: str, observation: str, history: list[str]) -> str:
    """``Focus into the textbox.`` -> click the text field."""
    field = _find(tree_lines(observation), ("textbox",))
    if field is None:
        raise LookupError("no text field")
    return f"click [{field.node_id}]"


def solve_click_option(objective: str, observation: str, history: list[str]) -> str:
    """``Select X and click Submit.`` -> pick radio X, then submit."""
    match = re.match(r"Select (.*) and click Submit\.", objective)
    if match is None:
        raise LookupError(f"unexpected objective {objective!r}")
    lines = tree_lines(observation)
    radio = _find(lines, ("radio",), match[1])
    if radio is None:
        raise LookupError(f"no option {match[1]!r}")
    if "checked: true" not in radio.rest.lower():
        return f"click [{radio.node_id}]"
    return _submit(lines)


Solver = Callable[[str, str, list[str]], str]
SOLVERS: dict[str, Solver] = {
    "click-button": solve_click_button,
    "click-link": solve_click_link,
    "click-checkboxes": solve_click_checkboxes,
    "click-option": solve_click_option,
    "enter-text": solve_enter_text,
    "enter-password": solve_enter_password,
    "login-user": solve_login_user,
    "focus-text": solve_focus_text,
}


# Views of the base splits: the same seeds, only these tasks (in `CURATED_TASKS` order).
SPLIT_VIEWS: dict[str, tuple[str, ...]] = {"solvable": tuple(name for name in CURATED_TASKS if name in SOLVERS)}


def split_tasks(view: str) -> tuple[str, ...]:
    """The task names of a split view (`SPLIT_VIEWS`; "" for the base splits: all curated tasks)."""
    if not view:
        return CURATED_TASKS
    if view not in SPLIT_VIEWS:
        raise UnknownTaskError(f"unknown MiniWoB split view {view!r}; views are {', '.join(sorted(SPLIT_VIEWS))}")
    return SPLIT_VIEWS[view]
