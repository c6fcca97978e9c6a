"""Shared fixtures of the trainer tests: a tiny policy and synthetic multi-turn trajectories."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import synthetic_trajectory

from agentgym.proto import rl_pb2

TINY = {"layers": 2, "hidden": 64, "heads": 4}


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A cached 2-layer x 64 random Llama with SmolLM2's tokenizer."""
    from agentgym.inference.models import tiny_model_dir

    return tiny_model_dir(**TINY)


@pytest.fixture(autouse=True)
def _few_threads() -> Iterator[None]:
    """The CI box is small and shared: one intra-op thread keeps timings stable and results deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_batch() -> Callable[..., list[rl_pb2.Trajectory]]:
    """``make_batch(seed, step, groups, group_size, **kw)``: whole groups of synthetic trajectories."""

    def build(seed: int, step: int, groups: int, group_size: int, **kw: Any) -> list[rl_pb2.Trajectory]:
        rng = random.Random(f"{seed}/{step}")
        return [
            synthetic_trajectory(rng, step=step, group=g, sample=s, **kw)
            for g in range(groups)
            for s in range(group_size)
        ]

    return build


@pytest.fixture
def config_factory(tiny_model: Path, tmp_path: Path) -> Callable[..., Any]:
    """``config_factory(**overrides)``: a small RLTrainerConfig on the tiny model in tmp_path."""
    from agentgym.trainer.config import RLTrainerConfig

    def build(**overrides: Any) -> RLTrainerConfig:
        values: dict[str, Any] = {
            "model": str(tiny_model),
            "output_dir": tmp_path / "run",
            "run": "test",
            "algorithm": "grpo",
            "group_size": 4,
            "mini_batch_size": 8,
            "micro_batch_tokens": 160,
            "learning_rate": 1e-3,
            "kl_coef": 0.0,
            "total_steps": 10,
            "tensorboard": False,
            "otel_metrics": False,
            "curriculum": {"kind": "fixed", "max_turns": 5},
        }
        values.update(overrides)
        return RLTrainerConfig(**values)

    return build
