"""SFT data from expert demonstrations, in exactly the token layout of a rollout.

AgentGym warm-starts agents by behaviour cloning on expert trajectories (AgentTraj). Here the
environments' scripted experts (``agentgym.envs.make_expert(name).demonstrate(task_id)``) give the
bare actions; each is replayed in-process to get the observations (an expert that reads the pages as
it goes, ``ObservingExpert``, chooses each action inside that one episode instead), and the conversation is
rendered with the SAME prompt template and token splicing as the rollout worker:

    prompt  = ChatTokenizer.prompt_ids(template.first_messages(first observation))
    turn k  = encode(reply_k) + [eos]                      loss 1 (what the model would sample)
              + ChatTokenizer.observation_ids(obs_k)[0]    loss 0 (not after the last turn)

``reply_k`` is ``"Thought: <thought>\\nAction: <action>"`` for the Thought/Action environments
(the rollout parser reads the action back from it), ``"<thought>\\n<search>...</search>"`` for
Deep Search and ``"<thought>\\n```<action>```"`` for WebArena. The thought is a short generic
sentence (the experts give actions only), or none at all (``thought=None``: the action line alone,
``"Action: <action>"``). Demonstrations whose replay does not succeed, or that do not fit the context, are skipped.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentgym.envs.base import ObservingExpert, play_expert
from agentgym.rollout.prompts import ActionFormat, PromptTemplate, template_for
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.trainer.batch import SFTExample

log = logging.getLogger(__name__)

__all__ = ["SFTBuildReport", "default_thought", "expert_sft_examples", "render_reply", "sample_task_ids"]


def default_thought(environment: str, action: str, turn: int) -> str:
    """A short, generic reasoning line for an expert action."""
    if turn == 0:
        return f"To work towards the goal, I will start with: {action}."
    return f"Given what I see now, the next step is: {action}."


def render_reply(action_format: ActionFormat, thought: str | None, action: str) -> str:
    """The assistant text for one turn, in the format the rollout parser reads; without a thought
    when `thought` is None."""
    if action_format == "thought_action":
        return f"Action: {action}" if thought is None else f"Thought: {thought}\nAction: {action}"
    if action_format == "search_tags":
        return action if thought is None else f"{thought}\n{action}"
    if action_format == "fenced":
        return f"```{action}```" if thought is None else f"{thought}\n```{action}```"
    raise ValueError(f"unknown action format {action_format!r}")


@dataclass
class SFTBuildReport:
    built: int = 0
    skipped_unsuccessful: int = 0
    skipped_errors: int = 0
    truncated: int = 0  # successful, but longer than the model's context: skipped


def sample_task_ids(environment: str, split: str, count: int, seed: int = 0) -> list[str]:
    """``count`` distinct task ids of ``split`` (all when fewer), deterministic for ``seed``."""
    from agentgym.envs import environment_class

    catalog = environment_class(environment).catalog()
    size = catalog.splits().get(split)
    if size is None:
        raise ValueError(f"{environment} has no split {split!r}")
    indices = random.Random(f"{seed}/{environment}/{split}").sample(range(size), min(count, size))
    return [catalog.task_id(split, i) for i in sorted(indices)]


@dataclass
class _Replay:
    """One expert demonstration replayed in an environment: what the rollout worker would have seen."""

    first_observation: str
    actions: list[str]
    observations: list[str]  # after each action
    success: bool


def expert_sft_examples(
    environment: str,
    task_ids: Sequence[str],
    chat: ChatTokenizer,
    *,
    template: PromptTemplate | None = None,
    thought: Callable[[str, str, int], str] | None = default_thought,
    max_tokens: int = 4096,
    make_env: Callable[[str], Any] | None = None,
    make_expert: Callable[[str], Any] | None = None,
    report: SFTBuildReport | None = None,
) -> list[SFTExample]:
    """SFT examples for ``task_ids`` of ``environment`` from its expert, replayed in-process.

    ``thought(environment, action, turn)`` writes each reply's thought; None leaves it out.
    """
    from agentgym import envs

    template = template or template_for(environment)
    make_env = make_env or envs.make
    expert = (make_expert or envs.make_expert)(environment)
    report = report if report is not None else SFTBuildReport()

    def replay(task_id: str) -> _Replay | Exception:
        env = make_env(environment)
        try:
            if isinstance(expert, ObservingExpert):  # it acts on this episode's pages: one play, not two
                episode = play_expert(expert, env, task_id)
                return _Replay(episode.first.observation, episode.actions, episode.observations, episode.success)
            actions = list(expert.demonstrate(task_id))
            first = env.reset(task_id)
            observations, success = [], False
            for action in actions:
                result = env.step(action)
                observations.append(result.observation)
                if result.done or result.truncated:
                    success = bool(result.info.get("success", False))
                    break
            return _Replay(first.observation, actions[: len(observations)], observations, success)
        except Exception as error:
            return error
        finally:
            env.close()

    examples = []
    for task_id in task_ids:
        played = replay(task_id)
        if isinstance(played, Exception):
            report.skipped_errors += 1
            log.warning("expert demonstration of %s/%s failed: %s", environment, task_id, played)
            continue
        if not played.success:
            report.skipped_unsuccessful += 1
            continue
        example = _render(environment, task_id, played, chat, template, thought, max_tokens)
        if example is None:
            report.truncated += 1
            continue
        examples.append(example)
        report.built += 1
    return examples


def _render(
    environment: str,
    task_id: str,
    played: _Replay,
    chat: ChatTokenizer,
    template: PromptTemplate,
    thought: Callable[[str, str, int], str] | None,
    max_tokens: int,
) -> SFTExample | None:
    """A replayed demonstration in the rollout's token layout; None when it does not fit in ``max_tokens``."""
    tokenizer = chat.tokenizer
    prompt = chat.prompt_ids(template.first_messages(played.first_observation))
    response: list[int] = []
    mask: list[int] = []
    for turn, (action, observation) in enumerate(zip(played.actions, played.observations, strict=True)):
        text = None if thought is None else thought(environment, action, turn)
        reply = render_reply(template.action_format, text, action)
        reply_ids = [*tokenizer.encode(reply, add_special_tokens=False), chat.eos_token_id]
        if len(prompt) + len(response) + len(reply_ids) > max_tokens:
            return None
        response += reply_ids
        mask += [1] * len(reply_ids)
        if turn == len(played.actions) - 1:
            break  # no observation after the last turn
        observation_ids, _ = chat.observation_ids(observation, True)
        if len(prompt) + len(response) + len(observation_ids) > max_tokens:
            return None
        response += observation_ids
        mask += [0] * len(observation_ids)
    return SFTExample(prompt, response, mask, environment, task_id)
