"""Checkpoints: exact resume (4 steps straight == 2 + resume + 2), layout, pruning, atomicity."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agentgym.proto import rl_pb2
from agentgym.trainer.checkpoint import checkpoint_dirs, latest_checkpoint
from agentgym.trainer.trainer import RLTrainer

ADAPTIVE = {
    "kind": "adaptive",
    "initial": 3,
    "minimum": 2,
    "maximum": 20,
    "increment": 2,
    "window": 1,
    "plateau_delta": 1.0,  # every window counts as a plateau: the horizon moves with truncation alone
    "truncation_threshold": 0.3,
    "patience": 1,
    "cooldown": 1,
}


def _run_steps(trainer: RLTrainer, make_batch: Callable[..., list[rl_pb2.Trajectory]], steps: range) -> list[int]:
    horizons = []
    for step in steps:
        batch = make_batch(11, step, groups=2, group_size=4, policy_version=trainer.policy_version)
        horizons.append(trainer.train_step(batch).horizon)
    return horizons


def _optimizer_tensors(trainer: RLTrainer) -> list[torch.Tensor]:
    state = trainer.engine.optimizer_state()["state"]
    return [t for key in sorted(state) for t in state[key].values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_resume_is_exact(
    algorithm: str,
    config_factory: Callable[..., Any],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
    tmp_path: Path,
) -> None:
    common = {"algorithm": algorithm, "curriculum": ADAPTIVE, "kl_coef": 0.01, "mini_batch_size": 4}
    straight = RLTrainer(config_factory(output_dir=tmp_path / "straight", **common))
    horizons_straight = _run_steps(straight, make_batch, range(4))

    first = RLTrainer(config_factory(output_dir=tmp_path / "resumed", **common))
    horizons_resumed = _run_steps(first, make_batch, range(2))
    rng_at_save = torch.get_rng_state()
    saved = first.save_checkpoint()
    assert saved.name == "step-2"
    del first
    torch.manual_seed(12345)  # a restarted process starts from some other RNG state
    second = RLTrainer(config_factory(output_dir=tmp_path / "resumed", **common))
    assert second.maybe_resume() == saved
    assert (second.step, second.policy_version) == (2, 2)
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    horizons_resumed += _run_steps(second, make_batch, range(2, 4))

    assert horizons_resumed == horizons_straight
    assert len(set(horizons_straight)) > 1  # the adaptive schedule did move
    assert second.schedule.state_dict() == straight.schedule.state_dict()
    assert second.seen_ids.to_list() == straight.seen_ids.to_list()
    for name, value in straight.policy.state_dict().items():
        assert torch.equal(value, second.policy.state_dict()[name]), name
    for a, b in zip(_optimizer_tensors(straight), _optimizer_tensors(second), strict=True):
        assert torch.equal(a, b)
    if algorithm == "ppo":
        assert straight.critic is not None and second.critic is not None
        for name, value in straight.critic.state_dict().items():
            assert torch.equal(value, second.critic.state_dict()[name]), name


def test_checkpoint_layout_hf_loadable_and_pruned(
    config_factory: Callable[..., Any], make_batch: Callable[..., list[rl_pb2.Trajectory]]
) -> None:
    from transformers import AutoModelForCausalLM

    trainer = RLTrainer(config_factory(keep_checkpoints=2, curriculum=ADAPTIVE))
    paths = []
    for step in range(3):
        _run_steps(trainer, make_batch, range(step, step + 1))
        paths.append(trainer.save_checkpoint())
    root = trainer.config.checkpoint_dir
    assert [n for n, _ in checkpoint_dirs(root)] == [2, 3]
    assert not paths[0].exists()
    assert latest_checkpoint(root) == paths[-1] == trainer.current_policy_dir
    files = {p.name for p in paths[-1].iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "optimizer.pt",
        "rng.pt",
        "trainer_state.json",
    } <= files
    state = json.loads((paths[-1] / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["policy_version"] == 3
    assert state["curriculum"] == trainer.schedule.state_dict()
    assert state["curriculum_state"]["horizon"] == trainer.schedule.current_horizon
    assert len(state["seen_trajectory_ids"]) == 24
    assert "all/reward_mean" in state["metrics"]

    loaded = AutoModelForCausalLM.from_pretrained(str(paths[-1]), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 300, 4000]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.policy(ids).logits)


def test_failed_save_leaves_previous_checkpoint(
    config_factory: Callable[..., Any],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = RLTrainer(config_factory())
    _run_steps(trainer, make_batch, range(1))
    good = trainer.save_checkpoint()
    _run_steps(trainer, make_batch, range(1, 2))

    def broken_save(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        trainer.save_checkpoint()
    root = trainer.config.checkpoint_dir
    assert [p.name for p in root.iterdir()] == ["step-1"]  # no half-written step-2, no temp folder
    assert latest_checkpoint(root) == good
    assert trainer.current_policy_dir == good


def test_a_resumed_trainer_uses_its_configured_learning_rate(
    config_factory: Callable[..., Any],
    make_batch: Callable[..., list[rl_pb2.Trajectory]],
    tmp_path: Path,
) -> None:
    # The optimiser state holds the lr it was saved with (e.g. `agentgym sft`'s trainer, or a spec edited
    # before --resume): loading it must not silently replace the configured one.
    first = RLTrainer(config_factory(output_dir=tmp_path / "run", learning_rate=2e-5))
    _run_steps(first, make_batch, range(1))
    first.save_checkpoint()
    resumed = RLTrainer(config_factory(output_dir=tmp_path / "run", learning_rate=3e-4))
    assert resumed.maybe_resume() is not None
    assert resumed.engine.get_lr() == 3e-4
    assert resumed.train_step(make_batch(11, 1, groups=2, group_size=4)).train["learning_rate"] == 3e-4
