"""Step metrics: rollout statistics per environment, and where metrics go (JSONL, TensorBoard, OTel).

Rollout statistics of a step (:func:`rollout_metrics`), over ALL trajectories the step received
(failed ones included), for each environment and for ``all``:

``reward_mean`` / ``reward_std``     outcome reward (normalised, see ``agentgym.trainer.rewards``);
                                    std is the population std
``success_rate``                     share with ``success``
``turns_mean``                       turns used
``horizon_max``                      the largest max turns the episodes were asked with (each environment's horizon)
``truncation_rate``                  share cut by the horizon (TERMINATION_HORIZON)
``context_limit_rate``               share ended by the context length
``failed_rate``                      share that failed (TERMINATION_ERROR)
``invalid_action_rate``              invalid turns / turns
``repeated_action_rate``             repeated turns / turns
``response_tokens_mean``, ``sampled_tokens_mean``, ``trajectories``

Flat keys are ``"<env>/<name>"`` (``"all/reward_mean"``); training statistics (KL, entropy, clip
fraction, grad norm, tokens/s, ...) are flat top-level keys. :class:`MetricsSink` writes every
step to ``<run dir>/metrics.jsonl``, to TensorBoard under ``<run dir>/tensorboard`` when the
``tensorboard`` package is installed (else a log line says it is skipped), and to OpenTelemetry
gauges ``agentgym.trainer.<name>``: rollout statistics with attributes ``run`` and ``environment``,
the rest (``/`` in a key becomes ``_``: ``count/used`` -> ``agentgym.trainer.count_used``) with ``run``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentgym.proto import rl_pb2
from agentgym.trainer.rewards import RewardConfig, outcome_reward

log = logging.getLogger(__name__)

__all__ = ["MetricsSink", "rollout_metrics"]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def _group_stats(trajectories: Sequence[rl_pb2.Trajectory], config: RewardConfig) -> dict[str, float]:
    n = len(trajectories)
    rewards = [outcome_reward(t, config) for t in trajectories]
    turns = [t for traj in trajectories for t in traj.turns]
    return {
        "trajectories": float(n),
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "success_rate": _mean([1.0 if t.success else 0.0 for t in trajectories]),
        "turns_mean": _mean([float(t.turns_used or len(t.turns)) for t in trajectories]),
        "horizon_max": float(max((t.horizon for t in trajectories), default=0)),
        "truncation_rate": _mean([1.0 if t.termination == rl_pb2.TERMINATION_HORIZON else 0.0 for t in trajectories]),
        "context_limit_rate": _mean(
            [1.0 if t.termination == rl_pb2.TERMINATION_CONTEXT_LIMIT else 0.0 for t in trajectories]
        ),
        "failed_rate": _mean([1.0 if t.termination == rl_pb2.TERMINATION_ERROR else 0.0 for t in trajectories]),
        "invalid_action_rate": _mean([1.0 if t.invalid_action else 0.0 for t in turns]),
        "repeated_action_rate": _mean([1.0 if t.repeated_action else 0.0 for t in turns]),
        "response_tokens_mean": _mean([float(len(t.response_token_ids)) for t in trajectories]),
        "sampled_tokens_mean": _mean([float(sum(1 for m in t.loss_mask if m)) for t in trajectories]),
    }


def rollout_metrics(trajectories: Sequence[rl_pb2.Trajectory], config: RewardConfig) -> dict[str, dict[str, float]]:
    """``{environment: stats, "all": stats}`` (see the module docstring)."""
    by_env: dict[str, list[rl_pb2.Trajectory]] = {}
    for trajectory in trajectories:
        by_env.setdefault(trajectory.environment or "unknown", []).append(trajectory)
    result = {env: _group_stats(items, config) for env, items in sorted(by_env.items())}
    result["all"] = _group_stats(list(trajectories), config)
    return result


class MetricsSink:
    """Writes step metrics to ``metrics.jsonl``, TensorBoard (optional) and OpenTelemetry gauges."""

    def __init__(
        self,
        run_dir: str | Path,
        run: str,
        *,
        tensorboard: bool = True,
        otel: bool = True,
        jsonl_name: str = "metrics.jsonl",
        meter_provider: Any = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.jsonl_path = self.run_dir / jsonl_name
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("tensorboard is not installed: TensorBoard metrics are skipped")
            else:
                self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._meter: Any = None
        self._gauges: dict[str, Any] = {}
        if otel:
            from opentelemetry import metrics

            if meter_provider is not None:
                self._meter = meter_provider.get_meter("agentgym.trainer")
            else:
                self._meter = metrics.get_meter("agentgym.trainer")

    @property
    def tensorboard_enabled(self) -> bool:
        return self._writer is not None

    def forget_from(self, step: int, *, sft_committed: bool) -> int:
        """Drop the ``metrics.jsonl`` lines a resumed trainer will write again; returns how many.

        A trainer resumes from its last checkpoint: the RL steps ``>= step`` were trained but never committed
        (their trajectories unacked, their weights unsaved), and so was an SFT warm-up without a checkpoint
        (``sft_committed`` False); their lines go, so each step, and each warm-up step, has one line."""
        if not self.jsonl_path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.jsonl_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
                line_step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                kept.append(line)  # not ours to judge: kept as it was
                continue
            warm_up = any(str(key).startswith("sft/") for key in record)
            if (not sft_committed) if warm_up else line_step >= step:
                dropped += 1
            else:
                kept.append(line)
        if dropped:
            temporary = self.jsonl_path.with_suffix(".tmp")
            temporary.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
            temporary.replace(self.jsonl_path)
        return dropped

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        """Write one step. ``record`` may nest ``{"env": {"all": {...}, "babyai": {...}}}`` and flat floats."""
        flat = flatten_metrics(record)
        line = {"step": step, **{k: v for k, v in record.items() if k != "env"}, "env": record.get("env", {})}
        with self.jsonl_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(line, default=_json_default) + "\n")
        if self._writer is not None:
            for key, value in flat.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._meter is not None:
            env_stats = record.get("env", {})
            for environment, stats in env_stats.items() if isinstance(env_stats, Mapping) else []:
                for name, value in stats.items():
                    if _is_number(value):
                        self._gauge(name).set(float(value), {"run": self.run, "environment": environment})
            for key, value in record.items():
                if key != "env" and _is_number(value):
                    self._gauge(key.replace("/", "_")).set(float(value), {"run": self.run})

    def _gauge(self, name: str) -> Any:
        gauge = self._gauges.get(name)
        if gauge is None:
            gauge = self._meter.create_gauge(f"agentgym.trainer.{name}")
            self._gauges[name] = gauge
        return gauge

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def flatten_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """Numeric leaves as ``{"loss": 0.1, "babyai/reward_mean": 0.5, ...}`` (``env`` level folded)."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        if key == "env" and isinstance(value, Mapping):
            for env, stats in value.items():
                for name, v in stats.items():
                    if _is_number(v):
                        flat[f"{env}/{name}"] = float(v)
        elif _is_number(value):
            flat[key] = float(value)
    return flat


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(float(value))


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    return repr(value)
