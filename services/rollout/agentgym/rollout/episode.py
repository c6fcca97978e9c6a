"""One episode of the agent loop: prompt -> policy -> parse -> env step -> observation, up to the horizon.

Failures are data: an environment error or timeout, or an inference error, ends the trajectory with
termination=ERROR and its reason (after retrying transient errors with backoff); nothing raises out
of `run_episode` except cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp
from opentelemetry import trace

from agentgym.envs.client import EnvServiceError, Opened, Stepped
from agentgym.proto import rl_pb2
from agentgym.rollout.parsing import parse_action
from agentgym.rollout.prompts import PromptTemplate
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.seeding import derive_seed

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Sample:
    """One model turn: exactly the ids sampled and the logprob of each under the policy."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    model: str = ""
    """The served model's name, as the server reported it."""
    cached_tokens: int | None = None
    """Prompt tokens the server took from its prefix cache (None when it does not say)."""


class PolicyError(RuntimeError):
    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class Policy(Protocol):
    provider: str
    """`gen_ai.provider.name` of the engine behind the policy (``agentgym`` for the HF engine, ``vllm``)."""

    @property
    def model_name(self) -> str | None:
        """The served model's name once known (after the first sample), for span names."""
        ...

    async def sample(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        seed: int | None,
    ) -> Sample: ...


class EnvSession(Protocol):
    async def create(
        self, task_id: str | None = None, split: str | None = None, index: int | None = None
    ) -> Opened: ...

    async def step(self, episode_id: str, action: str) -> Stepped: ...

    async def close(self, episode_id: str) -> None: ...


@dataclass(frozen=True)
class RewardShaping:
    """Optional per-turn penalties (off by default): they are added to that turn's reward."""

    invalid_action_penalty: float = 0.0
    repeated_action_penalty: float = 0.0


@dataclass(frozen=True)
class EpisodeSettings:
    max_context_tokens: int = 4096
    retries: int = 3
    retry_base_delay_s: float = 0.2
    shaping: RewardShaping = RewardShaping()


def is_transient(error: BaseException) -> bool:
    if isinstance(error, EnvServiceError):
        return error.status in TRANSIENT_STATUSES
    if isinstance(error, PolicyError):
        return error.transient
    return isinstance(error, aiohttp.ClientConnectionError | asyncio.TimeoutError | ConnectionError)


async def with_retries(call: Callable[[], Awaitable[T]], retries: int, base_delay: float) -> T:
    """`call()`, retried on transient errors with exponential backoff and jitter."""
    attempt = 0
    while True:
        try:
            return await call()
        except Exception as error:
            if attempt >= retries or not is_transient(error):
                raise
            delay = base_delay * (2**attempt) * (0.5 + random.random())
            attempt += 1
            log.info("transient error (%s), retry %d/%d in %.2fs", error, attempt, retries, delay)
            await asyncio.sleep(delay)


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def run_episode(
    request: rl_pb2.RolloutRequest,
    env: EnvSession,
    policy: Policy,
    chat: ChatTokenizer,
    template: PromptTemplate,
    settings: EpisodeSettings = EpisodeSettings(),
    tracer: trace.Tracer | None = None,
) -> rl_pb2.Trajectory:
    """Play `request` to the end (done, horizon, context limit or error) and return its trajectory."""
    tracer = tracer or trace.get_tracer("agentgym.rollout")
    trajectory = rl_pb2.Trajectory(
        run=request.run,
        # One trajectory per request: a redelivered request re-publishes under the same id, which
        # JetStream's duplicate window and the trainer's dedup both drop.
        trajectory_id=request.request_id,
        request_id=request.request_id,
        step=request.step,
        group_id=request.group_id,
        sample_index=request.sample_index,
        task_id=request.task_id,
        environment=request.environment,
        policy_version=request.policy_version,
        horizon=request.max_turns,
    )
    trajectory.timings.started_at = time.time()
    agent = f"agentgym-{request.environment}"
    attributes: dict[str, str | int] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": agent,
        "gen_ai.provider.name": policy.provider,
        "gen_ai.conversation.id": trajectory.trajectory_id,
        "agentgym.env": request.environment,
        "agentgym.task_id": request.task_id,
        "agentgym.horizon": request.max_turns,
        "agentgym.policy_version": request.policy_version,
        "agentgym.step": request.step,
        "agentgym.group_id": request.group_id,
        "agentgym.sample_index": request.sample_index,
    }
    if policy.model_name:
        attributes["gen_ai.request.model"] = policy.model_name
    with tracer.start_as_current_span(f"invoke_agent {agent}", attributes=attributes) as span:
        episode_id: str | None = None
        try:
            started = time.perf_counter()
            opened = await with_retries(
                lambda: env.create(task_id=request.task_id), settings.retries, settings.retry_base_delay_s
            )
            trajectory.timings.env_seconds += time.perf_counter() - started
            episode_id = opened.episode_id
            await _Episode(trajectory, opened, request, env, policy, chat, template, settings, tracer).play()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            trajectory.termination = rl_pb2.TERMINATION_ERROR
            trajectory.termination_reason = _describe(error)
            span.record_exception(error)
            span.set_status(trace.Status(trace.StatusCode.ERROR, trajectory.termination_reason))
        finally:
            if episode_id is not None:
                try:
                    await env.close(episode_id)
                except Exception as error:  # closing is best effort: the service reaps idle episodes
                    log.debug("closing episode %s: %s", episode_id, error)
        trajectory.turns_used = len(trajectory.turns)
        trajectory.timings.finished_at = time.time()
        span.set_attributes(
            {
                "agentgym.reward": trajectory.final_score,
                "agentgym.success": trajectory.success,
                "agentgym.turns": trajectory.turns_used,
                "agentgym.termination": rl_pb2.Termination.Name(trajectory.termination),
                "agentgym.termination_reason": trajectory.termination_reason,
            }
        )
    return trajectory


class _Episode:
    """The state of one episode being played: the growing id sequence and its aligned mask/logprobs."""

    def __init__(
        self,
        trajectory: rl_pb2.Trajectory,
        opened: Opened,
        request: rl_pb2.RolloutRequest,
        env: EnvSession,
        policy: Policy,
        chat: ChatTokenizer,
        template: PromptTemplate,
        settings: EpisodeSettings,
        tracer: trace.Tracer,
    ) -> None:
        self.trajectory = trajectory
        self.opened = opened
        self.request = request
        self.env = env
        self.policy = policy
        self.chat = chat
        self.template = template
        self.settings = settings
        self.tracer = tracer
        self.prompt = chat.prompt_ids(template.first_messages(opened.observation))
        self.response: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.seen: set[tuple[str, str]] = set()  # (observation, action): repeated-action detection
        self.observation = opened.observation

    async def play(self) -> None:
        self.trajectory.prompt_token_ids.extend(self.prompt)
        try:
            for turn_index in range(self.request.max_turns):
                if not await self._traced_turn(turn_index):
                    break
        finally:  # keep what was played even when the episode ends in an error
            self.trajectory.response_token_ids.extend(self.response)
            self.trajectory.loss_mask.extend(self.mask)
            self.trajectory.sampled_logprobs.extend(self.logprobs)

    async def _traced_turn(self, turn_index: int) -> bool:
        """`_turn` inside a ``turn {n}`` span: the episode's tree reads episode -> turns -> chat, execute_tool."""
        number = turn_index + 1
        with self.tracer.start_as_current_span(f"turn {number}", attributes={"agentgym.turn": number}) as span:
            go_on = await self._turn(turn_index)
            turns = self.trajectory.turns
            if len(turns) == number:
                turn = turns[-1]
                span.set_attributes(
                    {
                        "agentgym.action": turn.action,
                        "agentgym.invalid_action": turn.invalid_action,
                        "agentgym.repeated_action": turn.repeated_action,
                        "agentgym.reward": turn.reward,
                        "agentgym.done": turn.done,
                    }
                )
            if not go_on:
                span.set_attribute("agentgym.termination", rl_pb2.Termination.Name(self.trajectory.termination))
            return go_on

    def _end(self, termination: int, reason: str = "") -> bool:
        self.trajectory.termination = termination  # type: ignore[assignment]
        self.trajectory.termination_reason = reason
        return False

    async def _sample(self, turn_index: int, max_tokens: int) -> Sample:
        request = self.request
        # Hashed, not ``seed + turn``: that would give turn 1 of one episode the stream of turn 0 of the next.
        seed = derive_seed(request.seed, "turn", turn_index) if request.seed else None
        context = self.prompt + self.response
        model = self.policy.model_name
        # The model is known from the first answer on; the very first span is renamed once it is.
        with self.tracer.start_as_current_span(f"chat {model or 'policy'}", kind=trace.SpanKind.CLIENT) as span:
            span.set_attributes(
                {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.provider.name": self.policy.provider,
                    "gen_ai.conversation.id": self.trajectory.trajectory_id,
                    "gen_ai.request.temperature": request.temperature,
                    "gen_ai.request.top_p": request.top_p or 1.0,
                    "gen_ai.request.max_tokens": max_tokens,
                    "gen_ai.usage.input_tokens": len(context),
                    "agentgym.turn": turn_index + 1,
                }
            )
            if model:
                span.set_attribute("gen_ai.request.model", model)
            sample = await with_retries(
                lambda: self.policy.sample(
                    context,
                    max_tokens=max_tokens,
                    temperature=request.temperature,
                    top_p=request.top_p or 1.0,
                    stop_token_ids=[self.chat.eos_token_id],
                    seed=seed,
                ),
                self.settings.retries,
                self.settings.retry_base_delay_s,
            )
            span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": len(sample.token_ids),
                    "gen_ai.response.finish_reasons": [sample.finish_reason],
                    "agentgym.policy_version": sample.policy_version,
                }
            )
            if sample.model:
                span.set_attribute("gen_ai.response.model", sample.model)
                if not model:
                    span.update_name(f"chat {sample.model}")
                    span.set_attribute("gen_ai.request.model", sample.model)
            if sample.cached_tokens is not None:
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", sample.cached_tokens)
        if len(sample.logprobs) != len(sample.token_ids):
            raise PolicyError(
                f"policy returned {len(sample.token_ids)} ids but {len(sample.logprobs)} logprobs", transient=False
            )
        return sample

    async def _step(self, action: str) -> Stepped:
        tool = f"{self.request.environment}.step"
        with self.tracer.start_as_current_span(f"execute_tool {tool}") as span:
            span.set_attributes(
                {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": tool,
                    "gen_ai.tool.type": "extension",
                    "gen_ai.tool.call.arguments": action,
                    "gen_ai.conversation.id": self.trajectory.trajectory_id,
                    "agentgym.action": action,
                }
            )
            stepped = await with_retries(
                lambda: self.env.step(self.opened.episode_id, action),
                self.settings.retries,
                self.settings.retry_base_delay_s,
            )
            span.set_attributes({"agentgym.reward": stepped.reward, "agentgym.done": stepped.done})
        if stepped.info.get("failed"):
            raise RuntimeError(f"environment failed: {stepped.info.get('error', 'unknown error')}")
        return stepped

    async def _turn(self, turn_index: int) -> bool:
        """Play one turn; False when the episode ended."""
        trajectory, settings = self.trajectory, self.settings
        max_tokens_per_turn = self.request.max_tokens_per_turn or 256
        budget = settings.max_context_tokens - len(self.prompt) - len(self.response)
        if budget < min(16, max_tokens_per_turn):
            return self._end(rl_pb2.TERMINATION_CONTEXT_LIMIT, f"context limit ({settings.max_context_tokens}) reached")

        started = time.perf_counter()
        sample = await self._sample(turn_index, min(max_tokens_per_turn, budget))
        turn = trajectory.turns.add()
        turn.inference_seconds = time.perf_counter() - started
        trajectory.timings.inference_seconds += turn.inference_seconds
        turn.action_start = len(self.response)
        self.response.extend(sample.token_ids)
        self.mask.extend([1] * len(sample.token_ids))
        self.logprobs.extend(sample.logprobs)
        turn.action_end = turn.observation_end = len(self.response)

        parsed = parse_action(self.template.action_format, self.chat.decode(sample.token_ids))
        reward, done = 0.0, False
        if parsed.action is None:
            turn.invalid_action = True
            next_observation = parsed.error or "Invalid reply."
        else:
            turn.action = parsed.action
            turn.repeated_action = (self.observation, parsed.action) in self.seen
            self.seen.add((self.observation, parsed.action))
            started = time.perf_counter()
            stepped = await self._step(parsed.action)
            turn.env_seconds = time.perf_counter() - started
            trajectory.timings.env_seconds += turn.env_seconds
            turn.invalid_action = bool(stepped.info.get("invalid_action", False))
            reward, done = stepped.reward, stepped.done or stepped.truncated
            trajectory.final_score = stepped.score
            trajectory.success = bool(stepped.info.get("success", False))
            next_observation = stepped.observation
        if turn.invalid_action:
            reward += settings.shaping.invalid_action_penalty
        if turn.repeated_action:
            reward += settings.shaping.repeated_action_penalty
        turn.reward, turn.done = reward, done
        if done:
            return self._end(rl_pb2.TERMINATION_DONE)
        if turn_index == self.request.max_turns - 1:
            return self._end(rl_pb2.TERMINATION_HORIZON, f"horizon of {self.request.max_turns} turns reached")

        ended_with_eos = bool(sample.token_ids) and sample.token_ids[-1] == self.chat.eos_token_id
        observation_ids, _ = self.chat.observation_ids(next_observation, ended_with_eos)
        if len(self.prompt) + len(self.response) + len(observation_ids) + 16 > settings.max_context_tokens:
            return self._end(rl_pb2.TERMINATION_CONTEXT_LIMIT, f"context limit ({settings.max_context_tokens}) reached")
        self.response.extend(observation_ids)
        self.mask.extend([0] * len(observation_ids))
        self.logprobs.extend([0.0] * len(observation_ids))
        turn.observation_end = len(self.response)
        self.observation = next_observation
        return True


def trajectory_summary(trajectory: rl_pb2.Trajectory) -> dict[str, Any]:
    """A small dict for logs."""
    return {
        "task": trajectory.task_id,
        "turns": trajectory.turns_used,
        "score": trajectory.final_score,
        "success": trajectory.success,
        "termination": rl_pb2.Termination.Name(trajectory.termination),
        "reason": trajectory.termination_reason,
    }
