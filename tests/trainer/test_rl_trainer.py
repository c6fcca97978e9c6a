"""RLTrainer.train_step without NATS: every algorithm, learning direction, dedup, failures, metrics outputs."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import fill_logprobs

from agentgym.proto import rl_pb2
from agentgym.trainer import policy as trainer_module
from agentgym.trainer.metrics import MetricsSink
from agentgym.trainer.trainer import RLTrainer, mini_batch_order


def _params(trainer: RLTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_plus_plus", "ppo"])
def test_train_step_each_algorithm(
    algorithm: str, config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    config = config_factory(algorithm=algorithm, kl_coef=0.01, entropy_coef=0.001, group_size=3, mini_batch_size=3)
    trainer = RLTrainer(config)
    batch = make_batch(1, 0, groups=2, group_size=3)
    fill_logprobs(trainer.policy, batch)
    before = _params(trainer)
    metrics = trainer.train_step(batch)
    assert (trainer.step, trainer.policy_version) == (1, 1)
    assert metrics.step == 0 and metrics.policy_version == 1 and metrics.horizon == 5
    assert metrics.counts["used"] == 6 and metrics.counts["duplicates"] == 0
    train = metrics.train
    for key in ("policy_loss", "entropy", "clip_fraction", "approx_kl", "kl", "grad_norm", "tokens_per_s"):
        assert key in train and train[key] == train[key]  # present and not NaN
    assert train["optimizer_steps"] == 2  # 6 trajectories / mini-batch 3
    # the engine's logprobs are the model's: the trainer sees the same numbers before updating
    assert train["logprob_diff_max"] < 1e-4
    assert train["grad_norm"] > 0
    if algorithm == "ppo":
        assert "value_loss" in train and train["critic_grad_norm"] > 0
    assert set(metrics.env) == {"textcraft", "all"}
    after = _params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_learning_rate_warms_up_linearly(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    """lrWarmupSteps W = 4 at 1e-3: steps 0..4 at 0.25, 0.5, 0.75, 1, 1 x 1e-3. A fresh AdamW's first update is
    lr * g / (|g| + eps) per weight (m and v are g and g^2 after bias correction): every weight with a gradient
    moves by lr_0 = 2.5e-4, not the configured 1e-3."""
    config = config_factory(learning_rate=1e-3, lr_warmup_steps=4, group_size=3, mini_batch_size=6)
    assert [config.learning_rate_at(s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert config_factory(learning_rate=1e-3).learning_rate_at(0) == 1e-3  # W = 0: no warm-up
    trainer = RLTrainer(config)
    rates = []
    for step in range(5):
        batch = make_batch(1, step, groups=2, group_size=3)
        fill_logprobs(trainer.policy, batch)
        before = _params(trainer)
        metrics = trainer.train_step(batch)
        assert metrics.train["optimizer_steps"] == 1
        if step == 0:
            after = _params(trainer)
            moved = max(float((after[k] - before[k]).abs().max()) for k in before)
            assert moved == pytest.approx(2.5e-4, rel=1e-3)
        rates.append(metrics.train["learning_rate"])
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert trainer.models.engine.get_lr() == 1e-3  # the configured rate between steps (a checkpoint saves it)


def test_recompute_old_logprobs_reports_engine_mismatch(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    trainer = RLTrainer(config_factory(recompute_old_logprobs=True))
    batch = make_batch(2, 0, groups=1, group_size=4)
    fill_logprobs(trainer.policy, batch)
    shifted = batch[1]
    values = [v - 0.5 if m else 0.0 for v, m in zip(shifted.sampled_logprobs, shifted.loss_mask, strict=True)]
    del shifted.sampled_logprobs[:]
    shifted.sampled_logprobs.extend(values)  # an engine that disagrees by 0.5 nat on one trajectory
    metrics = trainer.train_step(batch)
    assert metrics.train["logprob_diff_max"] == pytest.approx(0.5, abs=1e-4)
    # recomputed old logprobs = current ones: the first update starts at ratio 1, nothing clipped
    assert metrics.train["clip_fraction"] < 0.5


def _sequence_logprob(trainer: RLTrainer, trajectory: rl_pb2.Trajectory) -> float:
    from agentgym.trainer.packing import response_logprobs_unpacked

    with torch.no_grad():
        ids = list(trajectory.prompt_token_ids) + list(trajectory.response_token_ids)
        lp = response_logprobs_unpacked(trainer.policy, ids, len(trajectory.prompt_token_ids))
    return float((lp * torch.tensor(list(trajectory.loss_mask), dtype=torch.float32)).sum())


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_updates_favour_the_successful_response(
    algorithm: str, config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    """One task, two answers: the successful one must become more likely, the failed one less."""
    trainer = RLTrainer(config_factory(algorithm=algorithm, learning_rate=3e-3, critic_learning_rate=1e-2))
    [good, bad] = make_batch(3, 0, groups=1, group_size=2, turns=1)
    good.success, good.final_score = True, 1.0
    bad.success, bad.final_score = False, 0.0
    bad.prompt_token_ids[:] = list(good.prompt_token_ids)
    start_good, start_bad = _sequence_logprob(trainer, good), _sequence_logprob(trainer, bad)
    for step in range(4):
        batch = []
        for sample in range(4):
            t = rl_pb2.Trajectory()
            t.CopyFrom(good if sample % 2 == 0 else bad)
            t.trajectory_id = f"s{step}/{sample}"
            t.group_id = f"g{step}"
            t.policy_version = trainer.policy_version
            batch.append(t)
        fill_logprobs(trainer.policy, batch)
        trainer.train_step(batch)
    assert _sequence_logprob(trainer, good) > start_good + 0.5
    assert _sequence_logprob(trainer, bad) < start_bad


def test_duplicates_failed_and_malformed(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    trainer = RLTrainer(config_factory())
    batch = make_batch(4, 0, groups=2, group_size=4)
    batch[0].termination = rl_pb2.TERMINATION_ERROR
    batch[0].termination_reason = "env crashed"
    duplicate = rl_pb2.Trajectory()
    duplicate.CopyFrom(batch[5])
    malformed = rl_pb2.Trajectory()
    malformed.CopyFrom(batch[6])
    malformed.trajectory_id = "bad-one"
    del malformed.sampled_logprobs[-1]
    metrics = trainer.train_step([*batch, duplicate, malformed])
    assert metrics.counts == {
        "received": 10,
        "duplicates": 1,
        "malformed": 1,
        "failed": 1,
        "uniform_groups": 0,  # counted only with drop_uniform_groups
        "used": 7,
    }
    assert metrics.env["all"]["failed_rate"] == pytest.approx(1 / 8)
    assert batch[0].trajectory_id in trainer.seen_ids

    # the same trajectories again (a redelivery): all dropped, no update
    before = _params(trainer)
    again = trainer.train_step(batch)
    assert again.counts["duplicates"] == 8 and again.counts["used"] == 0
    after = _params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)

    # failed trajectories are trained on when asked
    trainer2 = RLTrainer(config_factory(train_on_failed=True, output_dir=trainer.config.output_dir / "b"))
    assert trainer2.train_step(batch).counts["used"] == 8


def test_metrics_jsonl_tensorboard_and_otel(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]], tmp_path: Path
) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    config = config_factory(output_dir=tmp_path / "metrics-run")
    sink = MetricsSink(config.run_dir, config.run, tensorboard=True, meter_provider=provider)
    trainer = RLTrainer(config, metrics_sink=sink)
    trainer.train_step(make_batch(5, 0, groups=2, group_size=4, environment="babyai"))
    assert sink.tensorboard_enabled
    trainer.close()
    lines = (config.run_dir / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    assert record["step"] == 0 and "babyai" in record["env"] and "grad_norm" in record
    assert list((config.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    data = reader.get_metrics_data()
    assert data is not None
    points = {
        (m.name, p.attributes.get("environment")): p.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    }
    assert ("agentgym.trainer.success_rate", "babyai") in points
    assert ("agentgym.trainer.grad_norm", None) in points
    assert points[("agentgym.trainer.count_used", None)] == 8


def test_gradient_checkpointing_gives_the_same_update(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]], tmp_path: Path
) -> None:
    batch = make_batch(6, 0, groups=2, group_size=4)
    plain = RLTrainer(config_factory(output_dir=tmp_path / "plain"))
    checkpointed = RLTrainer(
        config_factory(output_dir=tmp_path / "ckpt", gradient_checkpointing=True, logits_chunk_tokens=7)
    )
    assert getattr(checkpointed.policy, "is_activation_checkpointing", False)
    assert not getattr(plain.policy, "is_activation_checkpointing", False)
    a = plain.train_step(batch)
    b = checkpointed.train_step(batch)
    assert a.train["grad_norm"] == pytest.approx(b.train["grad_norm"], rel=1e-4)
    for name, value in plain.policy.state_dict().items():
        torch.testing.assert_close(value, checkpointed.policy.state_dict()[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_shared_prompts_give_the_same_update_on_fewer_tokens(
    algorithm: str,
    config_factory: Callable[..., Any],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
    tmp_path: Path,
) -> None:
    batch = make_batch(8, 0, groups=2, group_size=4)
    prompts = {t.group_id: list(t.prompt_token_ids) for t in reversed(batch)}  # each group's first sample's
    for t in batch:  # a group's samples start from one prompt, as the rollout workers' do
        del t.prompt_token_ids[:]
        t.prompt_token_ids.extend(prompts[t.group_id])
    # adam_eps 1e-4: Adam's first step is ~lr * sign(g), so float noise on a gradient near 0 (summed in
    # another order here) could flip a whole step; with a larger eps such updates stay ~linear in g.
    trainers = {
        share: RLTrainer(
            config_factory(
                output_dir=tmp_path / str(share),
                algorithm=algorithm,
                share_prompts=share,
                kl_coef=0.01,
                adam_eps=1e-4,
            )
        )
        for share in (False, True)
    }
    separate, shared = (trainers[share].train_step(batch) for share in (False, True))
    prompt_tokens = sum(len(t.prompt_token_ids) for t in batch)
    distinct_prompt_tokens = sum(len(t.prompt_token_ids) for t in batch if t.sample_index == 0)
    assert separate.train["tokens"] - shared.train["tokens"] == prompt_tokens - distinct_prompt_tokens
    assert separate.train["grad_norm"] == pytest.approx(shared.train["grad_norm"], rel=1e-4)
    for name, value in trainers[False].policy.state_dict().items():
        torch.testing.assert_close(value, trainers[True].policy.state_dict()[name], atol=1e-6, rtol=1e-5)


def test_mini_batch_order_keeps_groups_together() -> None:
    group_ids = [f"g{i // 4}" for i in range(12)]  # 3 groups of 4
    order = mini_batch_order(group_ids, torch.Generator().manual_seed(3))
    assert sorted(order) == list(range(12))
    chunks = [order[k : k + 4] for k in range(0, 12, 4)]
    assert all(len({group_ids[i] for i in chunk}) == 1 for chunk in chunks)  # each mini-batch of 4: one group
    assert order == mini_batch_order(group_ids, torch.Generator().manual_seed(3))  # seeded
    orders = {tuple(mini_batch_order(group_ids, torch.Generator().manual_seed(s))) for s in range(20)}
    assert len({tuple(group_ids[order[k]] for k in (0, 4, 8)) for order in orders}) > 1  # group order varies
    assert len({order[:4] for order in orders}) > 3  # groups and members both shuffled
    # off: a plain permutation, the same the generator gives
    assert (
        mini_batch_order(group_ids, torch.Generator().manual_seed(3), by_group=False)
        == torch.randperm(12, generator=torch.Generator().manual_seed(3)).tolist()
    )


def test_mini_batches_by_group_forward_each_prompt_once_per_mini_batch(
    config_factory: Callable[..., Any],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
    tmp_path: Path,
) -> None:
    batch = make_batch(9, 0, groups=4, group_size=4)
    prompts = {t.group_id: list(t.prompt_token_ids) for t in reversed(batch)}
    for t in batch:  # shared prompts, as the rollout workers send them
        del t.prompt_token_ids[:]
        t.prompt_token_ids.extend(prompts[t.group_id])
    tokens = {}
    for by_group in (True, False):
        config = config_factory(
            output_dir=tmp_path / str(by_group),
            mini_batch_size=4,
            micro_batch_tokens=4096,
            mini_batches_by_group=by_group,
        )
        metrics = RLTrainer(config).train_step(batch)
        assert metrics.train["optimizer_steps"] == 4
        tokens[by_group] = metrics.train["tokens"]
    responses = sum(len(t.response_token_ids) for t in batch)
    assert tokens[True] == responses + sum(len(p) for p in prompts.values())  # every prompt forwarded once
    assert tokens[False] > tokens[True]  # shuffled across groups: a prompt per group drawn per mini-batch


def test_drop_uniform_groups_trains_on_the_mixed_groups_only(
    config_factory: Callable[..., Any],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
    tmp_path: Path,
) -> None:
    outcomes = [[True] * 4, [False] * 4, [True, False, False, True]]  # all won, all lost, mixed
    batch = []
    for g, group_outcomes in enumerate(outcomes):
        for t, won in zip(make_batch(11 + g, 0, groups=1, group_size=4), group_outcomes, strict=True):
            t.group_id, t.task_id = f"g{g}", f"task-{g}"
            t.trajectory_id = f"g{g}/{t.sample_index}"
            t.success, t.final_score = won, float(won)
            t.turns[0].invalid_action = t.sample_index == 1  # shaping credit in every group
            batch.append(t)
    common = {"mini_batch_size": 16, "invalid_action_penalty": 0.1, "turn_validity_coef": 1.0, "adam_eps": 1e-4}
    dropping = RLTrainer(config_factory(output_dir=tmp_path / "drop", drop_uniform_groups=True, **common))
    metrics = dropping.train_step(batch)
    assert metrics.counts["uniform_groups"] == 2 and metrics.counts["used"] == 4
    assert metrics.env["all"]["success_rate"] == pytest.approx(6 / 12)  # rollout statistics keep every episode
    # the same update as a trainer that is given the mixed group alone
    plain = RLTrainer(config_factory(output_dir=tmp_path / "plain", **common))
    assert plain.train_step(batch[8:]).counts["uniform_groups"] == 0
    for name, value in plain.policy.state_dict().items():
        torch.testing.assert_close(value, dropping.policy.state_dict()[name], atol=1e-6, rtol=1e-5)
    # nothing mixed: no update, the step still counts
    only_uniform = RLTrainer(config_factory(output_dir=tmp_path / "uniform", drop_uniform_groups=True, **common))
    before = _params(only_uniform)
    metrics = only_uniform.train_step(batch[:8])
    assert metrics.counts["uniform_groups"] == 2 and metrics.counts["used"] == 0 and only_uniform.step == 1
    assert all(torch.equal(before[k], v) for k, v in _params(only_uniform).items())


def test_bf16_autocast_step_runs(
    config_factory: Callable[..., Any],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trainer_module, "cpu_has_bf16_units", lambda: True)  # the autocast path on any CPU
    trainer = RLTrainer(config_factory(bf16=True))
    assert trainer.autocast_dtype == torch.bfloat16 and next(trainer.policy.parameters()).dtype == torch.float32
    metrics = trainer.train_step(make_batch(7, 0, groups=1, group_size=4))
    assert all(v == v for v in metrics.train.values())  # no NaN
    assert metrics.train["grad_norm"] > 0


def test_bf16_on_a_cpu_without_bf16_units_trains_in_float32_and_says_so(
    config_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(trainer_module, "cpu_has_bf16_units", lambda: False)
    with caplog.at_level(logging.WARNING, logger=trainer_module.__name__):
        trainer = RLTrainer(config_factory(bf16=True))
    assert trainer.autocast_dtype is None
    assert "no bf16 units" in caplog.text and "float32" in caplog.text
    assert RLTrainer(config_factory(bf16=False)).autocast_dtype is None


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_turn_validity_credit_is_added_to_the_outcome_advantage(
    algorithm: str, config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    """Two successful episodes of one task (outcome advantage 0); the first wasted its first turn."""
    trainer = RLTrainer(config_factory(algorithm=algorithm, group_size=2, turn_validity_coef=0.5))
    first, second = make_batch(5, 0, groups=1, group_size=2, turns=2, success=True)
    first.turns[0].invalid_action = True
    batch = trainer._batch([first, second])
    advantages, _, _ = trainer._advantages(batch, batch.sampled_logprobs, None)
    # Turn values [-1, 0 | 0, 0]: mean -1/4, unbiased std 1/2 -> -1.5 and 0.5 (see test_advantages); x 0.5.
    expected = torch.zeros_like(advantages)
    for row, trajectory in enumerate([first, second]):
        for k, turn in enumerate(trajectory.turns):
            expected[row, turn.action_start : turn.action_end] = -0.75 if (row, k) == (0, 0) else 0.25
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    # Without the coefficient the two equal outcomes give nothing to learn from.
    plain = RLTrainer(config_factory(algorithm=algorithm, group_size=2, output_dir=trainer.config.output_dir / "b"))
    assert float(plain._advantages(batch, batch.sampled_logprobs, None)[0].abs().sum()) == 0.0


def test_turn_validity_credit_can_require_a_success_in_the_group(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    """Two groups with the same wasted first turn: one succeeded in both samples, one failed in both."""
    trainer = RLTrainer(config_factory(group_size=2, turn_validity_coef=0.5))
    assert trainer.config.turn_validity_needs_success  # the default
    won = make_batch(5, 0, groups=1, group_size=2, turns=2, success=True)
    lost = make_batch(6, 0, groups=1, group_size=2, turns=2, success=False)
    for t in lost:
        t.group_id = "lost"
    won[0].turns[0].invalid_action = lost[0].turns[0].invalid_action = True
    batch = trainer._batch([*won, *lost])
    advantages, _, _ = trainer._advantages(batch, batch.sampled_logprobs, None)
    # The won group gets the credit of the test above (-0.75 / 0.25); the lost group, with no outcome
    # signal either, gets nothing rather than a lesson in validity alone.
    expected = torch.zeros_like(advantages)
    for row, trajectory in enumerate(won):
        for k, turn in enumerate(trajectory.turns):
            expected[row, turn.action_start : turn.action_end] = -0.75 if (row, k) == (0, 0) else 0.25
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    # Ungated, the lost group is credited the same way as the won one.
    ungated = RLTrainer(
        config_factory(
            group_size=2,
            turn_validity_coef=0.5,
            turn_validity_needs_success=False,
            output_dir=trainer.config.output_dir / "b",
        )
    )
    advantages, _, _ = ungated._advantages(batch, batch.sampled_logprobs, None)
    for row, trajectory in enumerate(lost, start=2):
        for k, turn in enumerate(trajectory.turns):
            expected[row, turn.action_start : turn.action_end] = -0.75 if (row, k) == (2, 0) else 0.25
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_step_group_credit_is_added_to_the_outcome_advantage(
    algorithm: str, config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    """Two successful episodes of one task, in 2 and 3 turns (outcome advantage 0 with success rewards)."""
    trainer = RLTrainer(
        config_factory(
            algorithm=algorithm, group_size=2, outcome_reward="success", step_group_coef=0.5, step_group_gamma=0.9
        )
    )
    (short,) = make_batch(5, 0, groups=1, group_size=1, turns=2, success=True)
    (long,) = make_batch(6, 0, groups=1, group_size=1, turns=3, success=True)  # other observations
    long.group_id, long.trajectory_id, long.sample_index = short.group_id, "long", 1
    batch = trainer._batch([short, long])
    advantages, _, _ = trainer._advantages(batch, batch.sampled_logprobs, None)
    # Only the first turns share a state (the prompt). Returns there: 0.9 and 0.81 -> z = +-0.70711
    # (two values), x 0.5. Later turns saw observations of their own: 0.
    expected = torch.zeros_like(advantages)
    for row, trajectory in enumerate([short, long]):
        first = trajectory.turns[0]
        expected[row, first.action_start : first.action_end] = 0.5 * (1 / math.sqrt(2)) * (1 if row == 0 else -1)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("algorithm", ["grpo", "reinforce_plus_plus"])
def test_negative_advantages_are_scaled(
    algorithm: str, config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    batch_trajectories = make_batch(6, 0, groups=2, group_size=2, turns=2)
    for k, t in enumerate(batch_trajectories):
        t.success, t.final_score = k % 2 == 0, float(k % 2 == 0)
    plain = RLTrainer(config_factory(algorithm=algorithm, group_size=2))
    batch = plain._batch(batch_trajectories)
    reference, _, _ = plain._advantages(batch, batch.sampled_logprobs, None)
    assert float(reference.min()) < 0 < float(reference.max())
    scaled_trainer = RLTrainer(
        config_factory(
            algorithm=algorithm, group_size=2, negative_advantage_scale=0.25, output_dir=plain.config.output_dir / "b"
        )
    )
    scaled, _, _ = scaled_trainer._advantages(batch, batch.sampled_logprobs, None)
    torch.testing.assert_close(scaled, torch.where(reference < 0, 0.25 * reference, reference))


def test_negative_scale_applies_to_the_outcome_part_not_the_turn_validity_credit(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    # One group: the first episode failed and wasted its first turn, the second succeeded cleanly.
    trainer = RLTrainer(config_factory(group_size=2, turn_validity_coef=1.0, negative_advantage_scale=0.5))
    first, second = make_batch(7, 0, groups=1, group_size=2, turns=2)
    first.success, first.final_score, second.success, second.final_score = False, 0.0, True, 1.0
    first.turns[0].invalid_action = True
    batch = trainer._batch([first, second])
    advantages, _, _ = trainer._advantages(batch, batch.sampled_logprobs, None)
    # Outcome: scores [0, 1] -> -+0.70711 (unbiased std sqrt(1/2)); the negative one halved: -0.35355.
    # Validity: [-1.5 on the invalid turn, 0.5 on the other three] (test_advantages), unscaled.
    outcome = 0.5 / math.sqrt(0.5)
    expected = torch.zeros_like(advantages)
    for row, trajectory in enumerate([first, second]):
        for k, turn in enumerate(trajectory.turns):
            validity = -1.5 if (row, k) == (0, 0) else 0.5
            expected[row, turn.action_start : turn.action_end] = (-0.5 * outcome if row == 0 else outcome) + validity
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=0)


def test_rft_trains_on_the_successes_only(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    """algorithm rft: one step is exactly the cross-entropy step on the successful trajectories' tokens."""
    config = config_factory(algorithm="rft", group_size=3, mini_batch_size=16, learning_rate=1e-3)
    batch = make_batch(4, 0, groups=2, group_size=3)
    for k, t in enumerate(batch):
        t.success, t.final_score = k % 2 == 0, float(k % 2 == 0)
    batch[2].termination = rl_pb2.TERMINATION_ERROR  # a success of a crashed episode: not learned from
    rft = RLTrainer(config)
    assert rft.reference is None  # klCoef's default does not build a reference rft never uses
    metrics = rft.train_step(batch)
    assert metrics.train["rft_examples"] == 2 and metrics.train["optimizer_steps"] == 1

    by_hand = RLTrainer(config_factory(algorithm="rft", group_size=3, learning_rate=1e-3, output_dir=config.run_dir))
    examples = RLTrainer.rejection_sampling_examples([batch[0], batch[4]])
    expected = by_hand.sft_step(examples, learning_rate=1e-3)
    assert metrics.train["sft_loss"] == pytest.approx(expected["sft_loss"])
    after, reference = _params(rft), _params(by_hand)
    assert all(torch.equal(after[k], reference[k]) for k in after)

    nothing = make_batch(5, 1, groups=1, group_size=3, success=False)
    assert rft.train_step(nothing).train["rft_examples"] == 0  # no success: no update


def test_dpo_pairs_each_groups_best_with_its_worst(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    """algorithm dpo: one step is exactly dpo_step on the groups' (best, worst) pairs, anchored to the start."""
    config = config_factory(algorithm="dpo", kl_coef=0.0, group_size=3, mini_batch_size=16, dpo_beta=0.2)
    batch = make_batch(6, 0, groups=3, group_size=3)
    for k, t in enumerate(batch):  # groups 0 and 1 mixed; group 2 all failed: no preference to learn
        t.success = k in (0, 4)
        t.final_score = float(t.success)
    dpo = RLTrainer(config)
    assert dpo.reference is not None  # DPO's anchor even with klCoef 0
    metrics = dpo.train_step(batch)
    assert metrics.train["dpo_pairs"] == 2 and metrics.train["optimizer_steps"] == 1
    assert metrics.train["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at the start

    by_hand = RLTrainer(config_factory(algorithm="dpo", kl_coef=0.0, group_size=3, output_dir=config.run_dir / "x"))
    pairs = RLTrainer.dpo_pairs(batch)
    chosen = [list(batch[0].response_token_ids), list(batch[4].response_token_ids)]
    assert [p.chosen.response_ids for p in pairs] == chosen
    by_hand.dpo_step(pairs, beta=0.2)
    after, reference = _params(dpo), _params(by_hand)
    assert all(torch.equal(after[k], reference[k]) for k in after)
