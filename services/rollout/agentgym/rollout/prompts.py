"""Per-environment prompts, faithful to AgentGym's conversation shape.

AgentGym opens every episode the same way: the task instruction as the first user message, a short
assistant acknowledgement, then the environment's first observation as the next user message. The
instruction names the action format the environment's parser expects:

- BabyAI, TextCraft, SciWorld: ``Thought: ...`` then ``Action: <one action>``;
- Deep Search: reasoning, then ``<search>query</search>`` or ``<answer>text</answer>``;
- WebArena: step-by-step reasoning, then the action in a fenced block (```click [12]```).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ActionFormat = Literal["thought_action", "search_tags", "fenced"]

_THOUGHT_ACTION = (
    "Answer every turn in exactly this form:\nThought: <your reasoning about what to do next>\nAction: <one action>"
)

BABYAI = f"""You are an agent in a grid world, and you must reach the goal you are given.
Each turn you receive what you currently see; reply with your reasoning and one action.
Available actions:
- turn left / turn right / move forward
- go to <object> <n>: walk next to an object you have seen, facing it
- pick up <object> <n>: go to an object and pick it up
- toggle <object> <n>: go to a door or box and open, close or unlock it
- drop: put down what you carry, in front of you
- check available actions: list what you can do now
Objects are named with their colour, kind and a number, e.g. "red ball 1" or "grey door 2".
{_THOUGHT_ACTION}"""

TEXTCRAFT = f"""You are crafting Minecraft items from basic materials, following the crafting commands given.
Actions:
- get <count> <item>: fetch a basic material
- craft <count> <item> using <count> <ingredient>, <count> <ingredient>, ...: craft with one of the listed recipes
- inventory: show what you have
Only basic materials (those no recipe makes) can be fetched; everything else must be crafted.
{_THOUGHT_ACTION}"""

SCIWORLD = f"""You are an agent doing science experiments in a simulated house with a kitchen, workshop, \
greenhouse and other rooms. Each turn you receive an observation; reply with your reasoning and one action.
Useful actions: look around, inventory, open/close <thing>, go to <place>, pick up <thing>, \
put <thing> in <container>, move <thing> to <container>, activate/deactivate <device>, use <tool> on <thing>, \
mix <container>, pour <thing> in <container>, focus on <thing> (only on what the task asks for), \
wait, wait1, read <thing>, connect <a> to <b>, teleport to <room>.
{_THOUGHT_ACTION}"""

DEEPSEARCH = """Answer the question by searching a Wikipedia index as many times as you need.
Reason first. To search, write <search>your query</search>; the results come back inside \
<information>...</information>. When you know the answer, write <answer>the short answer</answer>, \
with no explanation inside the tags. Write exactly one <search> or one <answer> per turn."""

WEBARENA = """You are a web agent completing a task in a browser. Each turn you see the page's accessibility \
tree as lines "[id] role 'name'", the URL, the objective and your previous action.
Actions:
- click [id] / hover [id] / type [id] [text] [1 to press Enter after, else 0]
- press [key combination] / scroll [up|down]
- new_tab / tab_focus [tab index] / close_tab / goto [url] / go_back / go_forward
- stop [answer]: finish; put the answer in the brackets (leave it empty if none is needed)
Think step by step, then give exactly one action inside a fenced block, e.g.
```click [12]```"""


@dataclass(frozen=True)
class PromptTemplate:
    environment: str
    instruction: str
    action_format: ActionFormat
    acknowledgement: str = "OK. I'll follow your instructions and try my best to solve the task."

    def first_messages(self, first_observation: str) -> list[dict[str, str]]:
        """The opening conversation, ready for the model's chat template."""
        return [
            {"role": "user", "content": self.instruction},
            {"role": "assistant", "content": self.acknowledgement},
            {"role": "user", "content": first_observation},
        ]


TEMPLATES: dict[str, PromptTemplate] = {
    "babyai": PromptTemplate("babyai", BABYAI, "thought_action"),
    "textcraft": PromptTemplate("textcraft", TEXTCRAFT, "thought_action"),
    "sciworld": PromptTemplate("sciworld", SCIWORLD, "thought_action"),
    "deepsearch": PromptTemplate("deepsearch", DEEPSEARCH, "search_tags"),
    "webarena": PromptTemplate("webarena", WEBARENA, "fenced"),
}


def template_for(environment: str) -> PromptTemplate:
    if environment not in TEMPLATES:
        raise ValueError(f"no prompt template for environment {environment!r}; known: {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[environment]
