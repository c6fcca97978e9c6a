"""The agent loop against the real tiny model and a real BabyAI service: token invariants, horizon, failures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentgym.envs.client import AsyncEnvClient
from agentgym.inference.client import CompletionClient
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import EpisodeSettings, PolicyError, Sample, run_episode
from agentgym.rollout.policy import InferencePolicy
from agentgym.rollout.prompts import template_for
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.seeding import derive_seed


class RecordingPolicy:
    """Wraps a policy and keeps every sample it returned (what the trajectory must contain verbatim)."""

    def __init__(self, inner: InferencePolicy, failures: list[PolicyError] | None = None) -> None:
        self.inner = inner
        self.samples: list[Sample] = []
        self.failures = list(failures or [])
        self.calls = 0
        self.seeds: list[object] = []

    provider = "agentgym"

    @property
    def model_name(self) -> str | None:
        return self.inner.model_name

    async def sample(self, prompt_ids: list[int], **kwargs: object) -> Sample:
        self.calls += 1
        self.seeds.append(kwargs.get("seed"))
        if self.failures:
            raise self.failures.pop(0)
        sample = await self.inner.sample(prompt_ids, **kwargs)  # type: ignore[arg-type]
        self.samples.append(sample)
        return sample


def request(max_turns: int = 3, task: str = "GoToRedBall/s1", max_tokens: int = 12) -> rl_pb2.RolloutRequest:
    return rl_pb2.RolloutRequest(
        run="test",
        request_id=f"r-{task}-{max_turns}",
        step=3,
        environment="babyai",
        task_id=task,
        group_id="g",
        max_turns=max_turns,
        policy_version=0,
        max_tokens_per_turn=max_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=7,
    )


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Iterator[torch.nn.Module]:
    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    loaded.eval()
    yield loaded


async def play(
    inference_url: str,
    env_url: str,
    chat: ChatTokenizer,
    req: rl_pb2.RolloutRequest,
    settings: EpisodeSettings | None = None,
    failures: list[PolicyError] | None = None,
) -> tuple[rl_pb2.Trajectory, RecordingPolicy]:
    async with CompletionClient(inference_url) as client, AsyncEnvClient(env_url) as env:
        policy = RecordingPolicy(InferencePolicy(client), failures)
        trajectory = await run_episode(req, env, policy, chat, template_for("babyai"), settings or EpisodeSettings())
    return trajectory, policy


async def test_token_in_token_out_invariants(
    inference_url: str, babyai_url: str, chat: ChatTokenizer, model: torch.nn.Module
) -> None:
    trajectory, policy = await play(inference_url, babyai_url, chat, request(max_turns=3))
    assert trajectory.termination in (rl_pb2.TERMINATION_HORIZON, rl_pb2.TERMINATION_DONE)
    assert trajectory.turns_used == len(trajectory.turns) == len(policy.samples) <= 3
    response = list(trajectory.response_token_ids)
    mask = list(trajectory.loss_mask)
    logprobs = list(trajectory.sampled_logprobs)
    assert len(response) == len(mask) == len(logprobs)
    # The sampled ids are in the trajectory verbatim, exactly where the turns say, and only they are masked in.
    sampled_positions: set[int] = set()
    for turn, sample in zip(trajectory.turns, policy.samples, strict=True):
        assert response[turn.action_start : turn.action_end] == sample.token_ids
        assert logprobs[turn.action_start : turn.action_end] == pytest.approx(sample.logprobs)
        sampled_positions.update(range(turn.action_start, turn.action_end))
    assert {i for i, m in enumerate(mask) if m == 1} == sampled_positions
    assert all(logprobs[i] == 0.0 for i in range(len(mask)) if mask[i] == 0)
    # Between turns: exactly the template's observation frame around the environment's reply.
    first = trajectory.turns[0]
    if len(trajectory.turns) > 1:
        between = chat.tokenizer.decode(response[first.action_end : first.observation_end])
        assert "<|im_start|>user\n" in between and between.endswith("<|im_start|>assistant\n")
    # The logprobs equal a re-scoring by the model with one plain forward pass over the whole sequence.
    ids = torch.tensor([list(trajectory.prompt_token_ids) + response])
    with torch.inference_mode():
        scores = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    offset = len(trajectory.prompt_token_ids)
    rescored = [float(scores[offset + i - 1, response[i]]) for i in sorted(sampled_positions)]
    assert rescored == pytest.approx([logprobs[i] for i in sorted(sampled_positions)], abs=2e-3)


async def test_each_turn_samples_from_its_own_stream(inference_url: str, babyai_url: str, chat: ChatTokenizer) -> None:
    seeded = request(max_turns=3)
    _, policy = await play(inference_url, babyai_url, chat, seeded)
    assert policy.seeds == [derive_seed(7, "turn", t) for t in range(len(policy.seeds))]
    # Not ``seed + turn``: turn 1 of the episode seeded 7 must not replay turn 0 of the episode seeded 8.
    neighbour = {derive_seed(8, "turn", t) for t in range(3)}
    assert len(set(policy.seeds)) == len(policy.seeds) and not neighbour & set(policy.seeds)
    unseeded = request(max_turns=2)
    unseeded.seed = 0  # proto3's unset value: every turn unseeded
    _, policy = await play(inference_url, babyai_url, chat, unseeded)
    assert policy.seeds == [None] * len(policy.seeds) and policy.seeds


async def test_horizon_truncates(inference_url: str, babyai_url: str, chat: ChatTokenizer) -> None:
    trajectory, _ = await play(inference_url, babyai_url, chat, request(max_turns=2))
    # A random tiny model does not solve BabyAI in two turns: the horizon ends it.
    assert trajectory.termination == rl_pb2.TERMINATION_HORIZON
    assert trajectory.turns_used == 2 and trajectory.horizon == 2
    assert "horizon of 2 turns" in trajectory.termination_reason
    assert trajectory.turns[-1].observation_end == trajectory.turns[-1].action_end  # nothing after the last action


async def test_invalid_replies_are_recorded_not_fatal(inference_url: str, babyai_url: str, chat: ChatTokenizer) -> None:
    trajectory, _ = await play(inference_url, babyai_url, chat, request(max_turns=3))
    # The untrained model rarely writes "Action: ..."; every such turn is marked invalid and play goes on.
    assert all(t.invalid_action or t.action for t in trajectory.turns)
    assert any(t.invalid_action for t in trajectory.turns)


async def test_context_limit_ends_cleanly(inference_url: str, babyai_url: str, chat: ChatTokenizer) -> None:
    probe, _ = await play(inference_url, babyai_url, chat, request(max_turns=1))
    limit = len(probe.prompt_token_ids) + 40
    trajectory, _ = await play(
        inference_url, babyai_url, chat, request(max_turns=10, max_tokens=16), EpisodeSettings(max_context_tokens=limit)
    )
    assert trajectory.termination == rl_pb2.TERMINATION_CONTEXT_LIMIT
    assert len(trajectory.prompt_token_ids) + len(trajectory.response_token_ids) <= limit


async def test_transient_inference_errors_are_retried(inference_url: str, babyai_url: str, chat: ChatTokenizer) -> None:
    failures = [PolicyError("503", transient=True), PolicyError("503", transient=True)]
    trajectory, policy = await play(
        inference_url, babyai_url, chat, request(max_turns=1), EpisodeSettings(retry_base_delay_s=0.01), failures
    )
    assert trajectory.termination == rl_pb2.TERMINATION_HORIZON and policy.calls == 3


async def test_permanent_inference_error_ends_the_episode_as_data(
    inference_url: str, babyai_url: str, chat: ChatTokenizer
) -> None:
    failures = [PolicyError("inference: 400 prompt too long", transient=False)]
    trajectory, _ = await play(inference_url, babyai_url, chat, request(max_turns=3), failures=failures)
    assert trajectory.termination == rl_pb2.TERMINATION_ERROR
    assert "prompt too long" in trajectory.termination_reason and trajectory.turns_used == 0


async def test_unreachable_environment_ends_as_error(inference_url: str, chat: ChatTokenizer) -> None:
    from agentgym.messaging import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    trajectory, _ = await play(
        inference_url, dead, chat, request(max_turns=2), EpisodeSettings(retries=1, retry_base_delay_s=0.01)
    )
    assert trajectory.termination == rl_pb2.TERMINATION_ERROR
    assert "Connect" in trajectory.termination_reason or "connect" in trajectory.termination_reason


async def test_unknown_task_ends_as_error(inference_url: str, babyai_url: str, chat: ChatTokenizer) -> None:
    trajectory, _ = await play(inference_url, babyai_url, chat, request(task="GoToRedBall/s999"))
    assert trajectory.termination == rl_pb2.TERMINATION_ERROR and "404" in trajectory.termination_reason
