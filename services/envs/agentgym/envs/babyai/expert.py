"""The BabyAI expert: minigrid's BabyAIBot, translated into this environment's macro actions.

The expert plays the task itself in a private `BabyAIEnv`: at each turn the bot proposes a
primitive action for the underlying level, the expert turns it into the equivalent macro
(``left`` -> ``turn left``, ``pickup`` -> ``pick up <name of the object in front>``, ...) and
steps the text environment with it, so the bot always sees the state the macro produced. Since
`BabyAIEnv.reset` is deterministic, replaying the returned actions on a fresh environment
reproduces the expert's episode exactly.

Demonstrations are primitive-grained (one macro per bot step), except that for a single "go to"
mission the expert, like a good agent, says ``go to <object n>`` as soon as a matching object
has been seen (the environment path-finds to it) instead of spelling out the walk. That keeps
demonstrations short (SFT data fits small contexts) and shows the macro actions in use.
`use_macros=False` gives the bot's trajectory step by step.

The bot occasionally loops forever while replanning (e.g. on some GoToImpUnlock layouts);
a search budget per decision turns that into a `BabyAIExpertError`.
"""

from __future__ import annotations

import re
from typing import Any

from minigrid.utils.baby_ai_bot import BabyAIBot

from agentgym.envs.babyai.env import BabyAIEnv
from agentgym.envs.babyai.world import DONE, DROP, FORWARD, LEFT, PICKUP, RIGHT, TOGGLE

# Breadth-first searches one bot decision may run before it counts as stuck. A normal decision
# runs at most about ten; the bot's replanning loops run them without end.
MAX_SEARCHES_PER_DECISION = 200

# A single "go to" mission, e.g. "go to the red ball" / "go to a grey key".
_GOTO_MISSION = re.compile(r"^go to (?:the|a) (?P<color>\w+) (?P<kind>\w+)$")


class BabyAIExpertError(RuntimeError):
    """The bot could not solve the task (it got stuck, gave up, or ran out of steps)."""


class _BotStuckError(Exception):
    pass


class _BudgetedBot(BabyAIBot):
    """BabyAIBot whose replanning is cut off after a fixed number of searches per decision."""

    def __init__(self, mission: Any, max_searches: int) -> None:
        self._max_searches = max_searches
        self._searches_left = max_searches
        super().__init__(mission)

    def replan(self, action_taken: int | None = None) -> int:
        self._searches_left = self._max_searches
        return int(super().replan(action_taken))

    def _breadth_first_search(self, initial_states: Any, accept_fn: Any, ignore_blockers: bool) -> Any:
        self._searches_left -= 1
        if self._searches_left < 0:
            raise _BotStuckError(f"more than {self._max_searches} searches for one decision")
        return super()._breadth_first_search(initial_states, accept_fn, ignore_blockers)


class BabyAIExpert:
    """Scripted solver for BabyAI tasks (`demonstrate(task_id) -> macro actions`)."""

    def __init__(self, *, max_steps: int | None = None, use_macros: bool = True) -> None:
        """`max_steps` must match the `BabyAIEnv` the demonstrations will be replayed in."""
        self._max_steps = max_steps
        self._use_macros = use_macros

    def demonstrate(self, task_id: str) -> list[str]:
        """Macro actions that solve `task_id` when replayed on a freshly reset `BabyAIEnv`.

        Raises UnknownTaskError for ids not in the catalog and BabyAIExpertError when the bot
        fails on this layout.
        """
        env = BabyAIEnv(max_steps=self._max_steps)
        try:
            return self._play(env, task_id)
        finally:
            env.close()

    def _play(self, env: BabyAIEnv, task_id: str) -> list[str]:
        env.reset(task_id)
        level = env.level_env
        bot = _BudgetedBot(level, MAX_SEARCHES_PER_DECISION)
        actions: list[str] = []
        # Every valid macro here costs one primitive step and the episode ends at max_steps;
        # the slack covers proposals the environment rejects (which cost no step).
        goto = _GOTO_MISSION.match(str(level.mission)) if self._use_macros else None
        for _ in range(2 * int(level.max_steps) + 10):
            if goto is not None:
                shortcut = self._goto_shortcut(env, goto["color"], goto["kind"])
                if shortcut is not None:
                    actions.append(shortcut)
                    return actions
            try:
                primitive = bot.replan()
            except _BotStuckError as stuck:
                raise BabyAIExpertError(f"BabyAIBot got stuck on {task_id}: {stuck}") from None
            except Exception as error:  # the bot asserts/raises when it gives up on a layout
                raise BabyAIExpertError(f"BabyAIBot failed on {task_id}: {type(error).__name__}: {error}") from error
            if primitive == DONE:
                raise BabyAIExpertError(f"BabyAIBot declared {task_id} done, but the mission is not complete")
            macro = self._macro(env, primitive)
            if macro is None:
                continue  # picking up / toggling an empty cell: a no-op in minigrid as well
            result = env.step(macro)
            if not result.info["invalid_action"]:
                # Rejected proposals are no-ops in minigrid too (bumping into a wall, dropping
                # onto an object); leaving them out changes nothing but the step count.
                actions.append(macro)
            if result.done or result.truncated:
                if result.info["success"]:
                    return actions
                outcome = "ran out of steps" if result.truncated else "failed the mission"
                raise BabyAIExpertError(f"BabyAIBot {outcome} on {task_id}")
        raise BabyAIExpertError(f"BabyAIBot made no progress on {task_id}")

    @staticmethod
    def _goto_shortcut(env: BabyAIEnv, color: str, kind: str) -> str | None:
        """A `go to <object n>` that completes the mission, when a matching object has been seen."""
        prefix = f"go to {color} {kind} "
        for action in env.available_actions() or []:
            if action.startswith(prefix):
                result = env.step(action)
                if result.info["success"]:
                    return action
                if not result.info["invalid_action"]:
                    # A valid walk that did not finish the mission changed the state under the bot.
                    raise BabyAIExpertError(f"'{action}' moved the agent without completing the mission")
        return None

    @staticmethod
    def _macro(env: BabyAIEnv, primitive: int) -> str | None:
        """The macro action equivalent to one primitive step; None when it would be a no-op."""
        if primitive == LEFT:
            return "turn left"
        if primitive == RIGHT:
            return "turn right"
        if primitive == FORWARD:
            return "move forward"
        if primitive == DROP:
            return "drop"
        if primitive in (PICKUP, TOGGLE):
            level = env.level_env
            # The cell in front is always in view, so whatever lies there has a name.
            front = env.world.of(level.grid.get(*level.front_pos))
            if front is None:
                return None
            return f"{'pick up' if primitive == PICKUP else 'toggle'} {front.name}"
        raise BabyAIExpertError(f"BabyAIBot proposed an unknown primitive action {primitive}")
