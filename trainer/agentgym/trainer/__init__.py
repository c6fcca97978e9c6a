"""The AgentGym-RL trainer: algorithms, curriculum, training loop, checkpoints, weight publishing.

Public names are imported lazily (``agentgym.trainer.advantages`` stays cheap to import)::

    from agentgym.trainer import RLTrainer, RLTrainerConfig
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RLTrainerConfig": "agentgym.trainer.config",
    "EnvironmentConfig": "agentgym.trainer.config",
    "RLTrainer": "agentgym.trainer.trainer",
    "StepMetrics": "agentgym.trainer.step",
    "SFTExample": "agentgym.trainer.batch",
    "DPOPair": "agentgym.trainer.batch",
    "TrajectoryCollector": "agentgym.trainer.collector",
    "CollectedBatch": "agentgym.trainer.collector",
    "RequestPublisher": "agentgym.trainer.publisher",
    "run_training": "agentgym.trainer.loop",
    "expert_sft_examples": "agentgym.trainer.sft",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentgym.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
