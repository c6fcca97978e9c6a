"""One card per environment kind: everything the platform's packages need to know about it, in one place.

The spec's `EnvironmentName` / `ENVIRONMENT_NAMES` and paper horizon presets, the trainer's ScalingInter-RL
presets and score scales, the rollout worker's prompt templates, `agentgym.envs`' class table and the
operator's default pod resources all derive from `ENVIRONMENTS`. It lives in `common` (imports nothing of
the platform) so that every deployable can read it without pulling in another one.

Adding an environment kind: its folder under services/envs/agentgym/envs/<name>/ and one card below (and
its name in the `EnvironmentName` literal, which a static type cannot be derived from; checked at import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ActionFormat = Literal["thought_action", "search_tags", "fenced"]
"""How the policy writes its action (see `agentgym.rollout.parsing`)."""

EnvironmentName = Literal["babyai", "textcraft", "sciworld", "deepsearch", "webarena"]


@dataclass(frozen=True)
class PodResources:
    """Kubernetes requests and limits of the operator's environment service pods."""

    cpu: str
    memory: str
    cpu_limit: str
    memory_limit: str
    shm_size: str | None = None
    """A memory-backed /dev/shm of this size (Chromium needs one)."""


@dataclass(frozen=True)
class EnvironmentCard:
    name: str
    instruction: str
    """The task instruction that opens every episode (it names the action format the parser expects)."""
    action_format: ActionFormat
    score_scale: float
    """The environment's score unit: final_score / score_scale is in [0, 1]."""
    horizons: tuple[int, ...]
    """The AgentGym-RL paper's ScalingInter-RL stages (max turns per episode), increasing."""
    stage_steps: int
    """Training steps per ScalingInter-RL stage in the paper."""
    resources: PodResources
    environment_class: str
    """"module:Class" of the `Environment`; imported lazily, each service image installs only its own engine."""
    expert_class: str
    """"module:Class" of its scripted `Expert`."""
    extra: str
    """The pyproject extra that installs the engine's dependencies (the service image installs only it)."""


_THOUGHT_ACTION = (
    "Answer every turn in exactly this form:\nThought: <your reasoning about what to do next>\nAction: <one action>"
)

BABYAI = EnvironmentCard(
    name="babyai",
    instruction=f"""You are an agent in a grid world, and you must reach the goal you are given.
Each turn you receive what you currently see; reply with your reasoning and one action.
Available actions:
- turn left / turn right / move forward
- go to <object> <n>: walk next to an object you have seen, facing it
- pick up <object> <n>: go to an object and pick it up
- toggle <object> <n>: go to a door or box and open, close or unlock it
- drop: put down what you carry, in front of you
- check available actions: list what you can do now
Objects are named with their colour, kind and a number, e.g. "red ball 1" or "grey door 2".
{_THOUGHT_ACTION}""",
    action_format="thought_action",
    score_scale=1.0,
    horizons=(6, 13, 20),
    stage_steps=100,
    resources=PodResources("500m", "512Mi", "2", "2Gi"),
    environment_class="agentgym.envs.babyai.env:BabyAIEnv",
    expert_class="agentgym.envs.babyai.expert:BabyAIExpert",
    extra="babyai",
)

TEXTCRAFT = EnvironmentCard(
    name="textcraft",
    instruction=f"""You are crafting Minecraft items from basic materials, following the crafting commands given.
Actions:
- get <count> <item>: fetch a basic material
- craft <count> <item> using <count> <ingredient>, <count> <ingredient>, ...: craft with one of the listed recipes
- inventory: show what you have
Only basic materials (those no recipe makes) can be fetched; everything else must be crafted.
{_THOUGHT_ACTION}""",
    action_format="thought_action",
    score_scale=1.0,
    horizons=(10, 20, 30),
    stage_steps=100,
    resources=PodResources("250m", "512Mi", "1", "1Gi"),
    environment_class="agentgym.envs.textcraft.env:TextCraftEnv",
    expert_class="agentgym.envs.textcraft.expert:TextCraftExpert",
    extra="textcraft",
)

SCIWORLD = EnvironmentCard(
    name="sciworld",
    instruction=f"""You are an agent doing science experiments in a simulated house with a kitchen, workshop, \
greenhouse and other rooms. Each turn you receive an observation; reply with your reasoning and one action.
Useful actions: look around, inventory, open/close <thing>, go to <place>, pick up <thing>, \
put <thing> in <container>, move <thing> to <container>, activate/deactivate <device>, use <tool> on <thing>, \
mix <container>, pour <thing> in <container>, focus on <thing> (only on what the task asks for), \
wait, wait1, read <thing>, connect <a> to <b>, teleport to <room>.
{_THOUGHT_ACTION}""",
    action_format="thought_action",
    # ScienceWorld scores in points out of 100.
    score_scale=100.0,
    horizons=(10, 20, 30),
    stage_steps=100,
    resources=PodResources("2", "8Gi", "4", "16Gi"),
    environment_class="agentgym.envs.sciworld.env:SciWorldEnv",
    expert_class="agentgym.envs.sciworld.expert:SciWorldExpert",
    extra="sciworld",
)

DEEPSEARCH = EnvironmentCard(
    name="deepsearch",
    instruction="""Answer the question by searching a Wikipedia index as many times as you need.
Reason first. To search, write <search>your query</search>; the results come back inside \
<information>...</information>. When you know the answer, write <answer>the short answer</answer>, \
with no explanation inside the tags. Write exactly one <search> or one <answer> per turn.""",
    action_format="search_tags",
    score_scale=1.0,
    horizons=(5, 8, 10),
    stage_steps=100,
    resources=PodResources("1", "2Gi", "2", "4Gi"),
    environment_class="agentgym.envs.deepsearch.env:DeepSearchEnv",
    expert_class="agentgym.envs.deepsearch.expert:DeepSearchExpert",
    extra="deepsearch",
)

WEBARENA = EnvironmentCard(
    name="webarena",
    instruction="""You are a web agent completing a task in a browser. Each turn you see the page's accessibility \
tree as lines "[id] role 'name'", the URL, the objective and your previous action.
Actions:
- click [id] / hover [id] / type [id] [text] [1 to press Enter after, else 0]
- press [key combination] / scroll [up|down]
- new_tab / tab_focus [tab index] / close_tab / goto [url] / go_back / go_forward
- stop [answer]: finish; put the answer in the brackets (leave it empty if none is needed)
Think step by step, then give exactly one action inside a fenced block, e.g.
```click [12]```""",
    action_format="fenced",
    score_scale=1.0,
    horizons=(8, 12, 15),
    # The paper moves WebArena to its next stage sooner.
    stage_steps=80,
    resources=PodResources("2", "4Gi", "4", "8Gi", shm_size="1Gi"),
    environment_class="agentgym.envs.webarena.env:WebArenaEnv",
    expert_class="agentgym.envs.webarena.env:WebArenaExpert",
    extra="webarena",
)

ENVIRONMENTS: dict[str, EnvironmentCard] = {c.name: c for c in (BABYAI, TEXTCRAFT, SCIWORLD, DEEPSEARCH, WEBARENA)}
"""Every environment kind, by name, in the platform's canonical order."""

ENVIRONMENT_NAMES: tuple[str, ...] = tuple(ENVIRONMENTS)

# The literal is what mypy and pydantic see; it must name exactly the cards (a card without it could not be
# put in a spec, a name without a card would fail at run time).
if get_args(EnvironmentName) != ENVIRONMENT_NAMES:
    raise RuntimeError(f"EnvironmentName {get_args(EnvironmentName)} does not match the cards {ENVIRONMENT_NAMES}")


def card(name: str) -> EnvironmentCard:
    """The card of environment kind `name` (ValueError naming the known ones otherwise)."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
    return ENVIRONMENTS[name]


__all__ = [
    "ENVIRONMENTS",
    "ENVIRONMENT_NAMES",
    "ActionFormat",
    "EnvironmentCard",
    "EnvironmentName",
    "PodResources",
    "card",
]
