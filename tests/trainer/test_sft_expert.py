"""SFT on expert demonstrations (rollout token layout), rejection-sampling fine-tuning, DPO pairs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agentgym.envs import environment_class, make
from agentgym.envs.client import Opened, Stepped
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import Sample, run_episode
from agentgym.rollout.parsing import parse_action
from agentgym.rollout.prompts import template_for
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.trainer.sft import SFTBuildReport, expert_sft_examples, render_reply, sample_task_ids
from agentgym.trainer.trainer import RLTrainer, SFTExample


@pytest.fixture(scope="module")
def chat(tiny_model: Path) -> ChatTokenizer:
    from agentgym.inference.models import load_tokenizer

    return ChatTokenizer(load_tokenizer(tiny_model))


@pytest.fixture(scope="module")
def tasks() -> list[str]:
    catalog = environment_class("textcraft").catalog()
    return [catalog.task_id("train", i) for i in range(3)]


@pytest.fixture(scope="module")
def examples(chat: ChatTokenizer, tasks: list[str]) -> list[SFTExample]:
    report = SFTBuildReport()
    built = expert_sft_examples("textcraft", tasks, chat, report=report)
    assert report.built == 3 and report.skipped_unsuccessful == 0 and report.skipped_errors == 0
    return built


def _spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 1 - value]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_examples_follow_the_rollout_format(chat: ChatTokenizer, examples: list[SFTExample]) -> None:
    from agentgym.envs import make_expert

    expert = make_expert("textcraft")
    for example in examples:
        actions = expert.demonstrate(example.task_id)
        first = make("textcraft").reset(example.task_id)
        assert example.prompt_ids == chat.prompt_ids(template_for("textcraft").first_messages(first.observation))
        replies = _spans(example.loss_mask, 1)
        assert len(replies) == len(actions)
        for (start, end), action in zip(replies, actions, strict=True):
            ids = example.response_ids[start:end]
            assert ids[-1] == chat.eos_token_id
            assert parse_action("thought_action", chat.decode(ids)).action == action
        observations = _spans(example.loss_mask, 0)
        assert len(observations) == len(actions) - 1  # none after the final action


class _InProcessEnv:
    """EnvSession over an in-process environment (what the env service does)."""

    def __init__(self) -> None:
        self.env = make("textcraft")

    async def create(self, task_id: str | None = None, split: str | None = None, index: int | None = None) -> Opened:
        assert task_id is not None
        first = self.env.reset(task_id)
        return Opened("e1", task_id, first.observation, None, {})

    async def step(self, episode_id: str, action: str) -> Stepped:
        r = self.env.step(action)
        return Stepped(r.observation, r.reward, r.score, r.done, r.truncated, None, r.info)

    async def close(self, episode_id: str) -> None:
        self.env.close()


class _Replay:
    """A policy that 'samples' exactly the SFT replies, in order."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)

    provider = "agentgym"
    model_name = "scripted"

    async def sample(self, prompt_ids: list[int], **kwargs: Any) -> Sample:
        ids = self.replies.pop(0)
        return Sample(ids, [-0.1] * len(ids), "stop", 0)


async def test_examples_match_a_real_rollout_token_for_token(chat: ChatTokenizer, examples: list[SFTExample]) -> None:
    example = examples[0]
    replies = [example.response_ids[s:e] for s, e in _spans(example.loss_mask, 1)]
    request = rl_pb2.RolloutRequest(
        request_id="r/0/0/0", environment="textcraft", task_id=example.task_id, max_turns=10, max_tokens_per_turn=256
    )
    trajectory = await run_episode(request, _InProcessEnv(), _Replay(replies), chat, template_for("textcraft"))
    assert trajectory.success and trajectory.termination == rl_pb2.TERMINATION_DONE
    assert list(trajectory.prompt_token_ids) == example.prompt_ids
    assert list(trajectory.response_token_ids) == example.response_ids
    assert list(trajectory.loss_mask) == example.loss_mask


async def test_an_episodes_spans_follow_the_genai_conventions(chat: ChatTokenizer, examples: list[SFTExample]) -> None:
    # The replayed expert episode, traced: invoke_agent -> turn n -> (chat, execute_tool), as the UI shows it.
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    example = examples[0]
    replies = [example.response_ids[s:e] for s, e in _spans(example.loss_mask, 1)]
    request = rl_pb2.RolloutRequest(
        request_id="r/0/0/0", step=4, group_id="g7", environment="textcraft", task_id=example.task_id,
        max_turns=10, max_tokens_per_turn=256, policy_version=3,
    )  # fmt: skip
    trajectory = await run_episode(
        request, _InProcessEnv(), _Replay(replies), chat, template_for("textcraft"), tracer=provider.get_tracer("t")
    )
    spans = {span.name: span for span in exported.get_finished_spans()}
    names = [span.name for span in exported.get_finished_spans()]
    agent = spans["invoke_agent agentgym-textcraft"]
    assert agent.parent is None and agent.attributes is not None
    assert {k: agent.attributes[k] for k in ("gen_ai.operation.name", "gen_ai.agent.name", "gen_ai.provider.name")} == {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "agentgym-textcraft",
        "gen_ai.provider.name": "agentgym",
    }  # fmt: skip
    assert agent.attributes["gen_ai.conversation.id"] == "r/0/0/0"
    assert agent.attributes["gen_ai.request.model"] == "scripted"
    assert agent.attributes["agentgym.termination"] == "TERMINATION_DONE"
    assert agent.attributes["agentgym.success"] is True
    assert (agent.attributes["agentgym.step"], agent.attributes["agentgym.group_id"]) == (4, "g7")
    assert agent.attributes["agentgym.policy_version"] == 3 and agent.attributes["agentgym.turns"] == len(replies)
    turns = [f"turn {n}" for n in range(1, len(replies) + 1)]
    assert [n for n in names if n.startswith("turn ")] == turns
    for number, name in enumerate(turns, start=1):
        turn = spans[name]
        assert turn.parent is not None and turn.parent.span_id == agent.context.span_id
        assert turn.attributes is not None and turn.attributes["agentgym.turn"] == number
        assert turn.attributes["agentgym.action"] == trajectory.turns[number - 1].action
    first = spans["turn 1"].context.span_id
    children = [s for s in exported.get_finished_spans() if s.parent and s.parent.span_id == first]
    assert [s.name for s in children] == ["chat scripted", "execute_tool textcraft.step"]
    chat_span, tool_span = children
    assert chat_span.attributes is not None and tool_span.attributes is not None
    # The first turn's context is the prompt alone; its output is the first expert reply.
    assert chat_span.attributes["gen_ai.usage.input_tokens"] == len(example.prompt_ids)
    assert chat_span.attributes["gen_ai.usage.output_tokens"] == len(replies[0])
    assert chat_span.attributes["gen_ai.request.model"] == "scripted" and chat_span.kind.name == "CLIENT"
    assert tool_span.attributes["gen_ai.tool.name"] == "textcraft.step"
    assert tool_span.attributes["gen_ai.tool.call.arguments"] == trajectory.turns[0].action
    assert spans[turns[-1]].attributes["agentgym.termination"] == "TERMINATION_DONE"  # type: ignore[index]


def test_sample_task_ids_is_deterministic() -> None:
    a = sample_task_ids("textcraft", "train", 5, seed=1)
    assert a == sample_task_ids("textcraft", "train", 5, seed=1)
    assert len(set(a)) == 5 and a != sample_task_ids("textcraft", "train", 5, seed=2)


def test_sft_warm_up_lowers_the_loss(config_factory: Callable[..., Any], examples: list[SFTExample]) -> None:
    trainer = RLTrainer(config_factory(sft_learning_rate=1e-2, micro_batch_tokens=512))
    history = trainer.sft(examples, steps=6, batch_size=3)
    assert history[-1]["sft_loss"] < 0.8 * history[0]["sft_loss"]
    assert trainer.sft_done and trainer.policy_version == 1
    assert trainer.engine.get_lr() == trainer.config.learning_rate  # restored after SFT


def test_rejection_sampling_and_dpo(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    batch = make_batch(21, 0, groups=2, group_size=4)
    for i, t in enumerate(batch):
        t.success = i % 2 == 0
        t.final_score = 1.0 if t.success else 0.0
    batch[2].termination = rl_pb2.TERMINATION_ERROR
    examples = RLTrainer.rejection_sampling_examples(batch)
    assert len(examples) == 3  # 4 successes, one of them failed as an episode
    assert all(e.response_ids and sum(e.loss_mask) for e in examples)

    trainer = RLTrainer(config_factory(learning_rate=5e-3))
    pairs = RLTrainer.dpo_pairs(batch)
    assert len(pairs) == 2
    first = trainer.dpo_step(pairs)
    assert first["dpo_loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference: -log sigmoid(0)
    for _ in range(3):
        last = trainer.dpo_step(pairs)
    assert last["dpo_loss"] < first["dpo_loss"] and last["reward_margin"] > 0

    rft = RLTrainer(config_factory(sft_learning_rate=1e-2, output_dir=trainer.config.output_dir / "rft"))
    losses = [rft.rejection_sampling_step(batch) for _ in range(3)]
    assert all(m is not None for m in losses)
    assert losses[-1]["sft_loss"] < losses[0]["sft_loss"]  # type: ignore[index]
    assert rft.rejection_sampling_step([t for t in batch if not t.success]) is None


def test_rl_after_the_warm_up_starts_with_a_fresh_optimiser(
    config_factory: Callable[..., Any],
    examples: list[SFTExample],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
) -> None:
    lr = 1e-4
    trainer = RLTrainer(config_factory(sft_learning_rate=1e-2, learning_rate=lr, micro_batch_tokens=512))
    trainer.sft(examples, steps=4, batch_size=3)
    assert trainer.engine.optimizer_state()["state"] == {}  # the SFT's moments are gone
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.train_step(make_batch(3, 0, groups=2, group_size=4, policy_version=trainer.policy_version))
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(trainer.policy.parameters(), before, strict=True))
    # A fresh AdamW's first step moves a parameter by lr (m_hat / sqrt(v_hat) = +-1); with the SFT's large
    # second moments carried over it moved far less.
    assert moved == pytest.approx(lr, rel=0.05)


def test_sft_can_keep_the_optimiser_state(config_factory: Callable[..., Any], examples: list[SFTExample]) -> None:
    trainer = RLTrainer(config_factory(sft_learning_rate=1e-2, micro_batch_tokens=512))
    trainer.sft(examples, steps=2, batch_size=3, mark_done=False)  # e.g. rejection-sampling rounds
    assert trainer.engine.optimizer_state()["state"] != {}


def test_the_kl_reference_is_the_warmed_up_policy_and_survives_a_resume(
    config_factory: Callable[..., Any],
    examples: list[SFTExample],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
    tmp_path: Path,
) -> None:
    config = config_factory(output_dir=tmp_path / "run", kl_coef=0.1, sft_learning_rate=1e-2, micro_batch_tokens=512)
    trainer = RLTrainer(config)
    raw = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    trainer.sft(examples, steps=3, batch_size=3)
    assert trainer.reference is not None
    for name, p in trainer.reference.named_parameters():  # the anchor moved with the warm-up
        assert torch.equal(p, dict(trainer.policy.named_parameters())[name].detach())
    assert any(not torch.equal(p, raw[name]) for name, p in trainer.reference.named_parameters())
    # At RL's first step the policy is its reference: the KL term starts at zero.
    metrics = trainer.train_step(make_batch(3, 0, groups=2, group_size=4, policy_version=trainer.policy_version))
    assert metrics.train["kl"] == pytest.approx(0.0, abs=1e-6)
    trainer.save_checkpoint()
    anchor = {name: p.detach().clone() for name, p in trainer.reference.named_parameters()}

    resumed = RLTrainer(config)
    assert resumed.maybe_resume() is not None
    assert resumed.reference is not None
    for name, p in resumed.reference.named_parameters():
        assert torch.equal(p, anchor[name])


def test_warm_up_demonstrations_are_replayed_with_the_environment_settings(chat: ChatTokenizer) -> None:
    from agentgym.trainer.config import EnvironmentConfig, RLTrainerConfig
    from agentgym.trainer.loop import build_warmup_examples

    def config(settings: dict[str, Any]) -> RLTrainerConfig:
        env = EnvironmentConfig("babyai", "train-easy", config=settings)
        return RLTrainerConfig(model="builtin:tiny", environments=[env], sft_tasks=4, max_context_tokens=2048)

    listed = build_warmup_examples(config({}), chat.tokenizer)
    bare = build_warmup_examples(config({"list_actions": False}), chat.tokenizer)
    assert [e.task_id for e in listed] == [e.task_id for e in bare]
    assert "Available actions: turn left" in chat.tokenizer.decode(listed[0].prompt_ids)
    assert "Available actions: turn left" not in chat.tokenizer.decode(bare[0].prompt_ids)
    assert sum(len(e.prompt_ids) for e in bare) < sum(len(e.prompt_ids) for e in listed)


def test_replies_without_a_thought_are_the_action_alone_and_parse_back() -> None:
    cases = {
        "thought_action": ("go to red ball 1", "Action: go to red ball 1"),
        "search_tags": ("<search>capital of France</search>", "<search>capital of France</search>"),
        "fenced": ("click [12]", "```click [12]```"),
    }
    for action_format, (action, text) in cases.items():
        assert render_reply(action_format, None, action) == text  # type: ignore[arg-type]
        assert render_reply(action_format, "I look.", action).endswith(text.removeprefix("Action: "))  # type: ignore[arg-type]
    assert render_reply("thought_action", "I look.", "turn left") == "Thought: I look.\nAction: turn left"
    assert parse_action("thought_action", "Action: go to red ball 1").action == "go to red ball 1"
    assert parse_action("fenced", "```click [12]```").action == "click [12]"


def test_warm_up_without_thoughts_demonstrates_the_action_lines_alone(chat: ChatTokenizer) -> None:
    from agentgym.envs import make_expert
    from agentgym.trainer.config import EnvironmentConfig, RLTrainerConfig
    from agentgym.trainer.loop import build_warmup_examples

    def config(thoughts: bool) -> RLTrainerConfig:
        env = EnvironmentConfig("babyai", "train-easy", config={"list_actions": False})
        return RLTrainerConfig(
            model="builtin:tiny", environments=[env], sft_tasks=4, max_context_tokens=2048, sft_thoughts=thoughts
        )

    thinking = build_warmup_examples(config(True), chat.tokenizer)
    bare = build_warmup_examples(config(False), chat.tokenizer)
    assert [e.task_id for e in thinking] == [e.task_id for e in bare]
    expert = make_expert("babyai")
    for with_thought, example in zip(thinking, bare, strict=True):
        assert example.prompt_ids == with_thought.prompt_ids  # the same instructions and first observation
        actions = list(expert.demonstrate(example.task_id))
        replies = [chat.decode(example.response_ids[s:e]) for s, e in _spans(example.loss_mask, 1)]
        assert replies == [f"Action: {action}" for action in actions]  # eos is a special token, not decoded
        long = [chat.decode(with_thought.response_ids[s:e]) for s, e in _spans(with_thought.loss_mask, 1)]
        assert all(text.startswith("Thought: ") for text in long)
        # The observations between the replies are the same tokens either way.
        assert [example.response_ids[s:e] for s, e in _spans(example.loss_mask, 0)] == [
            with_thought.response_ids[s:e] for s, e in _spans(with_thought.loss_mask, 0)
        ]
    trained = sum(sum(e.loss_mask) for e in bare)
    assert trained < 0.5 * sum(sum(e.loss_mask) for e in thinking)


def test_a_stop_during_the_warm_up_leaves_it_unfinished(
    config_factory: Callable[..., Any], examples: list[SFTExample]
) -> None:
    trainer = RLTrainer(config_factory(sft_learning_rate=1e-2, micro_batch_tokens=512))
    asked: list[int] = []

    def stop_after_two() -> bool:
        asked.append(1)
        return len(asked) > 2

    history = trainer.sft(examples, steps=10, batch_size=3, should_stop=stop_after_two)
    assert len(history) == 2  # two steps ran, the third was not started
    assert not trainer.sft_done and trainer.policy_version == 0  # a resume redoes the warm-up
    assert trainer.engine.optimizer_state()["state"] != {}  # not reset: the warm-up did not finish


def test_a_failed_demonstration_is_skipped_and_the_rest_keep_task_order(
    chat: ChatTokenizer, examples: list[SFTExample]
) -> None:
    catalog = environment_class("textcraft").catalog()
    more = [catalog.task_id("train", i) for i in range(8)]

    class FailsOnTask4:
        def __init__(self) -> None:
            from agentgym.envs import make_expert

            self.expert = make_expert("textcraft")

        def demonstrate(self, task_id: str) -> list[str]:
            if task_id == more[4]:
                raise RuntimeError("the expert broke")
            return list(self.expert.demonstrate(task_id))

    report = SFTBuildReport()
    built = expert_sft_examples("textcraft", more, chat, make_expert=lambda _: FailsOnTask4(), report=report)
    assert [e.task_id for e in built] == [t for t in more if t != more[4]]
    assert report == SFTBuildReport(built=7, skipped_errors=1)
    assert built[:3] == examples  # the same examples as the fixture's


def test_a_demonstration_longer_than_the_context_is_skipped(chat: ChatTokenizer, tasks: list[str]) -> None:
    report = SFTBuildReport()
    prompt_length = len(
        chat.prompt_ids(template_for("textcraft").first_messages(make("textcraft").reset(tasks[0]).observation))
    )
    assert expert_sft_examples("textcraft", tasks[:1], chat, max_tokens=prompt_length + 3, report=report) == []
    assert report == SFTBuildReport(truncated=1)
