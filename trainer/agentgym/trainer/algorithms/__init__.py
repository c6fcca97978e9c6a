"""One module per algorithm; :data:`ALGORITHMS` picks it from the spec's ``algorithm.name``.

Every module exposes ``update(batch, policy, options, step) -> metrics`` and has its formula in its
docstring. The advantage estimators (grpo, rloo, reinforce_pp, ppo) also expose
``advantages(batch, old, ref, policy, options)`` and train the policy through the clipped update of
:mod:`.actor` (PPO adds its critic update); rft and dpo update the policy directly; :mod:`.sft` is
the supervised step they and the SFT warm-up share.

Adding an algorithm: a module here, its line in :data:`ALGORITHMS`, its name in the spec's
``AlgorithmSpec.name`` literal (and ``config.Algorithm``).
"""

from __future__ import annotations

from typing import Protocol

from agentgym.trainer.algorithms import dpo, grpo, ppo, reinforce_pp, rft, rloo
from agentgym.trainer.batch import TrainBatch
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.policy import Policy

__all__ = ["ALGORITHMS", "Algorithm"]


class Algorithm(Protocol):
    """What the step calls (modules satisfy it: their module-level ``update``)."""

    def update(self, batch: TrainBatch, policy: Policy, options: RLTrainerConfig, step: int) -> dict[str, float]: ...


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_pp,
    "ppo": ppo,
    "rft": rft,
    "dpo": dpo,
}
