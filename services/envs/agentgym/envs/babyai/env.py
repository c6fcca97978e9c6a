"""BabyAI as a text environment: minigrid levels behind AgentGym-style words and macro actions.

Actions (bare strings, case-insensitive):

- ``turn left`` / ``turn right`` / ``move forward``: one primitive minigrid step each;
- ``go to <object>``: walk to a cell next to the object and face it;
- ``pick up <object>``: go to it, then pick it up (keys, balls, boxes; hands must be empty);
- ``toggle <object>``: go to it, then toggle it (open/close/unlock a door, open a box);
- ``drop``: put the carried object on the (empty) cell in front;
- ``check available actions``: list the valid actions without acting.

Objects are named ``<color> <type> <n>`` when first seen (see `world`). Macros are compiled into
primitive steps by breadth-first search over the cells the agent has seen so far; unseen cells
and closed doors count as walls, so the agent must open doors itself and explore to find
objects it has not seen. A plan that the mission completes half-way stops there.

Reward is minigrid's own: ``1 - 0.9 * step_count / max_steps`` on the step that completes the
mission, counting primitive steps (a 5-step ``go to`` costs 5). ``done`` is minigrid's
`terminated` (success, or failure in strict levels); ``truncated`` means minigrid's primitive
step limit ran out. Either ends the episode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from minigrid.core.world_object import Door
from minigrid.envs.babyai.core.roomgrid_level import RoomGridLevel

from agentgym.envs.babyai import text
from agentgym.envs.babyai.engine import make_level, reset_level
from agentgym.envs.babyai.levels import BabyAITask, catalog, parse_task_id
from agentgym.envs.babyai.world import (
    DROP,
    FORWARD,
    LEFT,
    PICKABLE_TYPES,
    PICKUP,
    RIGHT,
    TOGGLE,
    TOGGLEABLE_TYPES,
    KnownObject,
    WorldModel,
)
from agentgym.envs.base import (
    Environment,
    EpisodeNotStartedError,
    ResetResult,
    StepResult,
    TaskCatalog,
)

CHECK_ACTIONS = "check available actions"
_OBJECT_ACTION_RE = re.compile(r"^(go to|pick up|toggle) (?:the )?([a-z]+ [a-z]+ [0-9]+)$")
_ALIASES = {"pickup": "pick up", "goto": "go to", "forward": "move forward"}
_STRIP_CHARS = " \t\r\n.!\"'`"


def normalize_action(action: str) -> str:
    """Lower-case, single-spaced, without surrounding quotes or a trailing full stop."""
    words = action.strip(_STRIP_CHARS).lower().split()
    if words and words[0] in _ALIASES:
        words[0:1] = _ALIASES[words[0]].split()
    return " ".join(words)


@dataclass
class _Outcome:
    """The effect of a run of primitive steps."""

    steps: int = 0
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    completed: bool = True  # every planned primitive ran (no early episode end)


class _InvalidAction(Exception):
    """An action that cannot be taken now; the message says why (it reaches the agent)."""


class BabyAIEnv(Environment):
    """One BabyAI episode driven by text macro actions (see the module docstring)."""

    name = "babyai"

    def __init__(self, *, max_steps: int | None = None, list_actions: bool = True) -> None:
        """`max_steps` fixes minigrid's primitive-step limit for every task; None keeps each
        level's own limit (BabyAI derives it from the maze size and the mission).

        `list_actions` ends every observation with the "Available actions: ..." line, as AgentGym
        does. Without it observations are ~40 % shorter (the list repeats every object in view two
        or three times), which makes small-model runs markedly cheaper; "check available actions"
        and `available_actions` still give the list."""
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be positive, got {max_steps}")
        if not isinstance(list_actions, bool):
            raise ValueError(f"list_actions must be true or false, got {list_actions!r}")
        self._max_steps_override = max_steps
        self._list_actions = list_actions
        self._level_name: str | None = None
        self._level: RoomGridLevel | None = None
        self._task: BabyAITask | None = None
        self._world: WorldModel | None = None
        self._actions: list[str] = []
        self._passable: np.ndarray | None = None
        self._score = 0.0
        self._terminated = False
        self._truncated = False
        self._success = False
        self._final_message = ""

    # -- Environment API --------------------------------------------------------------------

    @classmethod
    def catalog(cls) -> TaskCatalog:
        return catalog()

    def reset(self, task_id: str) -> ResetResult:
        task = parse_task_id(task_id)
        if self._level is None or self._level_name != task.level:
            # A level object is reusable across seeds: re-create it only when the level changes.
            self._level = make_level(task.level, self._max_steps_override)
            self._level_name = task.level
        level = self._level
        obs = reset_level(level, task.seed)
        self._task = task
        self._world = WorldModel(level.width, level.height)
        self._world.update(level, obs["image"])
        self._score = 0.0
        self._terminated = self._truncated = self._success = False
        self._final_message = ""
        self._refresh_actions()
        return ResetResult(
            observation=self.observe(),
            available_actions=list(self._actions),
            info={
                "task_id": task.task_id,
                "split": task.split,
                "level": task.level,
                "seed": task.seed,
                "mission": level.mission,
                "max_steps": level.max_steps,
            },
        )

    def observe(self) -> str:
        level, world = self._require_episode()
        goal = f"Your goal: {level.mission}"
        if self._episode_over:
            return f"{goal}\n{self._final_message}"
        return f"{goal}\n{text.describe_state(level, world, self._listed_actions)}"

    @property
    def _listed_actions(self) -> list[str] | None:
        """The actions an observation lists (None: observations do not list them)."""
        return self._actions if self._list_actions else None

    def available_actions(self) -> list[str] | None:
        if self._level is None or self._task is None:
            return None
        return [] if self._episode_over else list(self._actions)

    def step(self, action: str) -> StepResult:
        level, world = self._require_episode()
        if self._episode_over:
            return self._result(f"The episode is over. {self._final_message}", reward=0.0, steps=0, invalid=True)
        command = normalize_action(action)
        if command == CHECK_ACTIONS:
            return self._result("You can take the following actions: " + ", ".join(self._actions), reward=0.0, steps=0)
        try:
            feedback, outcome = self._execute(command, level, world)
        except _InvalidAction as problem:
            return self._result(
                f"Invalid action {action.strip()!r}: {problem}"
                + (f"\n{text.available_actions_line(self._actions)}" if self._list_actions else ""),
                reward=0.0,
                steps=0,
                invalid=True,
            )

        self._score += outcome.reward
        # Mirrors minigrid, which can report both flags when the last allowed step succeeds.
        self._terminated, self._truncated = outcome.terminated, outcome.truncated
        if outcome.terminated:
            self._success = outcome.reward > 0
            verdict = "You completed the task." if self._success else "The task has failed."
            self._final_message = f"{feedback}\n{verdict}"
        elif outcome.truncated:
            self._final_message = f"{feedback}\nYou ran out of steps ({level.max_steps} primitive steps)."
        if self._episode_over:
            return self._result(self._final_message, reward=outcome.reward, steps=outcome.steps)
        if outcome.steps:
            self._refresh_actions()
        observation = f"{feedback}\n{text.describe_state(level, world, self._listed_actions)}"
        return self._result(observation, reward=outcome.reward, steps=outcome.steps)

    def close(self) -> None:
        self._level = self._world = self._task = self._passable = None
        self._level_name = None
        self._actions = []

    # -- introspection (tests, the expert) ----------------------------------------------------

    @property
    def level_env(self) -> RoomGridLevel:
        """The underlying minigrid level of the current episode."""
        return self._require_episode()[0]

    @property
    def world(self) -> WorldModel:
        """What the agent knows in the current episode."""
        return self._require_episode()[1]

    @property
    def success(self) -> bool:
        return self._success

    @property
    def score(self) -> float:
        return self._score

    # -- internals --------------------------------------------------------------------------

    @property
    def _episode_over(self) -> bool:
        return self._terminated or self._truncated

    def _require_episode(self) -> tuple[RoomGridLevel, WorldModel]:
        if self._level is None or self._world is None or self._task is None:
            raise EpisodeNotStartedError("call reset(task_id) before step/observe")
        return self._level, self._world

    def _result(self, observation: str, *, reward: float, steps: int, invalid: bool = False) -> StepResult:
        level = self._level
        assert level is not None
        return StepResult(
            observation=observation,
            reward=reward,
            done=self._terminated,
            truncated=self._truncated,
            score=self._score,
            available_actions=[] if self._episode_over else list(self._actions),
            info={
                "invalid_action": invalid,
                "success": self._success,
                "primitive_steps": steps,
                "step_count": int(level.step_count),
                "max_steps": int(level.max_steps),
            },
        )

    def _refresh_actions(self) -> None:
        """Recompute the valid actions; called whenever the state changed."""
        level, world = self._require_episode()
        passable = world.passable(level)
        reached = world.reachable(level, passable)
        front = level.grid.get(*level.front_pos)
        actions = ["turn left", "turn right"]
        if front is None or front.can_overlap():
            actions.append("move forward")
        carrying = level.carrying
        for known in world.present_objects():
            if known.pos is None or not world.can_reach(known.pos, reached):
                continue
            actions.append(f"go to {known.name}")
            if carrying is None and known.type in PICKABLE_TYPES:
                actions.append(f"pick up {known.name}")
            if known.type in TOGGLEABLE_TYPES:
                actions.append(f"toggle {known.name}")
        if carrying is not None and front is None:
            actions.append("drop")
        actions.append(CHECK_ACTIONS)
        self._actions = actions
        self._passable = passable

    def _run(self, level: RoomGridLevel, world: WorldModel, primitives: list[int]) -> _Outcome:
        outcome = _Outcome()
        for index, primitive in enumerate(primitives):
            obs, reward, terminated, truncated, _ = level.step(primitive)
            world.update(level, obs["image"])
            outcome.steps += 1
            outcome.reward += float(reward)
            if terminated or truncated:
                outcome.terminated, outcome.truncated = bool(terminated), bool(truncated)
                outcome.completed = index == len(primitives) - 1
                break
        return outcome

    def _execute(self, command: str, level: RoomGridLevel, world: WorldModel) -> tuple[str, _Outcome]:
        """Run one (normalised) macro action; raises _InvalidAction if it cannot be taken."""
        if command == "turn left":
            return "You turned left.", self._run(level, world, [LEFT])
        if command == "turn right":
            return "You turned right.", self._run(level, world, [RIGHT])
        if command == "move forward":
            front = level.grid.get(*level.front_pos)
            if front is not None and not front.can_overlap():
                raise _InvalidAction(f"you cannot move forward, {text.facing_phrase(level, world)} is in the way.")
            return "You moved forward.", self._run(level, world, [FORWARD])
        if command == "drop":
            return self._drop(level, world)
        match = _OBJECT_ACTION_RE.match(command)
        if match is None:
            raise _InvalidAction("this is not an action I understand.")
        verb, name = match[1], match[2]
        target = self._target(world, name)
        if verb == "go to":
            return self._go_to(level, world, target)
        if verb == "pick up":
            return self._pick_up(level, world, target)
        return self._toggle(level, world, target)

    def _target(self, world: WorldModel, name: str) -> KnownObject:
        known = world.by_name(name)
        if known is None:
            raise _InvalidAction(f"you have not seen any object called {name!r}.")
        if known.carried:
            raise _InvalidAction(f"you are carrying {name}.")
        if known.pos is None:
            raise _InvalidAction(f"{name} is no longer there.")
        return known

    def _plan(self, level: RoomGridLevel, world: WorldModel, target: KnownObject) -> list[int]:
        assert target.pos is not None and self._passable is not None
        plan = world.plan_to_face(level, target.pos, self._passable)
        if plan is None:
            raise _InvalidAction(
                f"you cannot reach {target.name} through the places you have seen "
                "(closed doors and unexplored areas block the way)."
            )
        return plan

    def _go_to(self, level: RoomGridLevel, world: WorldModel, target: KnownObject) -> tuple[str, _Outcome]:
        plan = self._plan(level, world, target)
        if not plan:
            return f"You are already facing {target.name}.", _Outcome()
        outcome = self._run(level, world, plan)
        if outcome.completed:
            return f"You went to {target.name} ({text.steps(outcome.steps)}) and now face it.", outcome
        return f"You headed for {target.name} ({text.steps(outcome.steps)}).", outcome

    def _pick_up(self, level: RoomGridLevel, world: WorldModel, target: KnownObject) -> tuple[str, _Outcome]:
        if target.type not in PICKABLE_TYPES:
            raise _InvalidAction(f"{target.name} cannot be picked up; only keys, balls and boxes can.")
        held = world.of(level.carrying)
        if level.carrying is not None:
            what = held.name if held is not None else "something"
            raise _InvalidAction(f"you are already carrying {what}; drop it first.")
        outcome = self._run(level, world, [*self._plan(level, world, target), PICKUP])
        if level.carrying is target.obj:
            return f"You picked up {target.name}.", outcome
        return f"You headed for {target.name} ({text.steps(outcome.steps)}).", outcome

    def _toggle(self, level: RoomGridLevel, world: WorldModel, target: KnownObject) -> tuple[str, _Outcome]:
        if target.type not in TOGGLEABLE_TYPES:
            raise _InvalidAction(f"{target.name} cannot be toggled; only doors and boxes can.")
        door = target.obj if isinstance(target.obj, Door) else None
        was_open = door is not None and door.is_open
        was_locked = door is not None and door.is_locked
        outcome = self._run(level, world, [*self._plan(level, world, target), TOGGLE])
        if not outcome.completed:
            return f"You headed for {target.name} ({text.steps(outcome.steps)}).", outcome
        if door is None:  # a box: toggling replaces it with its contents
            inside = world.of(level.grid.get(*level.front_pos))
            contents = f"it held {inside.name}" if inside is not None else "it was empty"
            return f"You opened {target.name}; {contents}.", outcome
        if was_locked and door.is_open:
            return f"You unlocked and opened {target.name}.", outcome
        if was_locked:
            return f"{target.name} is locked; you need to carry a {door.color} key to unlock it.", outcome
        return f"You {'closed' if was_open else 'opened'} {target.name}.", outcome

    def _drop(self, level: RoomGridLevel, world: WorldModel) -> tuple[str, _Outcome]:
        held = level.carrying
        if held is None:
            raise _InvalidAction("you are not carrying anything.")
        if level.grid.get(*level.front_pos) is not None:
            raise _InvalidAction(
                f"the cell in front of you is not empty ({text.facing_phrase(level, world)}); "
                "objects can only be dropped on empty floor."
            )
        known = world.of(held)
        outcome = self._run(level, world, [DROP])
        name = known.name if known is not None else "what you carried"
        return f"You dropped {name} in front of you.", outcome
