"""Turn the model's text into the bare action the environment takes.

AgentGym's clients parse the model output themselves and send bare actions; so do we. A reply that
does not follow the format yields no action and a message telling the model what was expected; the
turn is then recorded as invalid and the message is the next observation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentgym.rollout.prompts import ActionFormat


@dataclass(frozen=True)
class ParsedAction:
    action: str | None
    error: str | None = None


_ACTION_LINE = re.compile(r"^\s*\**\s*action\s*\**\s*:\s*\**\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_SEARCH_OR_ANSWER = re.compile(r"<(search|answer)>(.*?)</\1>", re.IGNORECASE | re.DOTALL)
_FENCED = re.compile(r"```(?:[a-zA-Z]*\n)?(.+?)```", re.DOTALL)

FORMAT_HELP: dict[ActionFormat, str] = {
    "thought_action": 'Your reply must end with a line "Action: <one action>" (after "Thought: ...").',
    "search_tags": "Your reply must contain <search>query</search> or <answer>short answer</answer>.",
    "fenced": "Your reply must contain exactly one action inside a fenced block, e.g. ```click [12]```.",
}


def parse_action(action_format: ActionFormat, text: str) -> ParsedAction:
    """The bare action in `text`, or an error message explaining the expected format."""
    if action_format == "thought_action":
        matches = _ACTION_LINE.findall(text)
        if not matches:
            return ParsedAction(None, f"No action found. {FORMAT_HELP[action_format]}")
        if len(matches) > 1:
            # Taking the last (or first) would let a policy hedge, listing several actions and being
            # credited for whichever is read: under RL it learns exactly that. One reply, one action.
            return ParsedAction(
                None, f'Found {len(matches)} "Action:" lines; give exactly one. {FORMAT_HELP[action_format]}'
            )
        action = matches[0].strip().strip("`").strip()
        # Models often close with punctuation or quotes around the action.
        action = action.rstrip(".").strip().strip('"').strip("'").strip()
        if not action:
            return ParsedAction(None, f"The action was empty. {FORMAT_HELP[action_format]}")
        return ParsedAction(action)
    if action_format == "search_tags":
        match = _SEARCH_OR_ANSWER.search(text)
        if match is None:
            return ParsedAction(None, f"No search or answer found. {FORMAT_HELP[action_format]}")
        # The Deep Search environment parses the tag itself: send the tagged span.
        return ParsedAction(f"<{match.group(1).lower()}>{match.group(2).strip()}</{match.group(1).lower()}>")
    if action_format == "fenced":
        blocks = [b.strip() for b in _FENCED.findall(text) if b.strip()]
        if len(blocks) != 1:
            found = "no" if not blocks else f"{len(blocks)}"
            return ParsedAction(None, f"Found {found} fenced actions. {FORMAT_HELP[action_format]}")
        return ParsedAction(blocks[0])
    raise ValueError(f"unknown action format {action_format!r}")
