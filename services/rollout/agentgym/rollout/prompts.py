"""Per-environment prompts, faithful to AgentGym's conversation shape.

AgentGym opens every episode the same way: the task instruction as the first user message, a short
assistant acknowledgement, then the environment's first observation as the next user message. The
instruction names the action format the environment's parser expects:

- BabyAI, TextCraft, SciWorld: ``Thought: ...`` then ``Action: <one action>``;
- Deep Search: reasoning, then ``<search>query</search>`` or ``<answer>text</answer>``;
- WebArena: step-by-step reasoning, then the action in a fenced block (```click [12]```).

The instructions and action formats are on the environment cards (`agentgym.environments`).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentgym.environments import ENVIRONMENTS, ActionFormat

__all__ = ["TEMPLATES", "ActionFormat", "PromptTemplate", "template_for"]


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
    name: PromptTemplate(name, card.instruction, card.action_format) for name, card in ENVIRONMENTS.items()
}


def template_for(environment: str) -> PromptTemplate:
    if environment not in TEMPLATES:
        raise ValueError(f"no prompt template for environment {environment!r}; known: {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[environment]
