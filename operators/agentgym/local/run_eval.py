"""The run's own evaluations: held-out success before training, after the SFT warm-up, and at the end.

`agentgym run` measures what a run learned on each environment's ``evalSplit`` with the services the run
already has (the inference server, the environment services), the same rollout loop, and a fixed set of
episodes: the first ``tasks`` tasks of the split, ``samples`` seeded samples each, at the horizon of the
final curriculum stage, sampled as the run samples (temperature, top-p) with its token budget. Three phases:

``start``  the initial policy, before any training;
``sft``    after the SFT warm-up (runs with ``trainer.sftWarmupSteps`` > 0), before the first RL step;
``end``    the final policy.

Each phase lands in ``<run>/eval/<phase>.json`` and in ``status.metrics`` as ``eval/<phase>/success``,
``eval/<phase>/success_se`` (standard error over tasks), ``eval/<phase>/episodes``, ``eval/<phase>/horizon``,
``eval/<phase>/seconds``. ``<run>/eval/summary.json`` holds the gains, what the SFT warm-up and RL each
contributed, and the wall time of each phase of the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentgym.rollout.tokens import ChatTokenizer
from agentgym.spec import EnvironmentSpec, TrainingRunSpec

if TYPE_CHECKING:
    from agentgym.local.evaluate import EvalSettings

PHASES = ("start", "sft", "end")
PHASE_LABELS = {"start": "before training", "sft": "after the SFT warm-up", "end": "at the end"}


@dataclass(frozen=True)
class RunEvalSettings:
    """How much the run evaluates: ``tasks`` tasks of each eval split, ``samples`` episodes each."""

    tasks: int = 100
    samples: int = 1
    enabled: bool = True
    horizon: int | None = None
    """Max turns of an eval episode; default: the final curriculum stage's horizon."""

    def __post_init__(self) -> None:
        if self.tasks < 1 or self.samples < 1:
            raise ValueError("eval tasks and samples must be >= 1")
        if self.horizon is not None and self.horizon < 1:
            raise ValueError("eval horizon must be >= 1")


@dataclass
class PhaseResult:
    """One evaluation of the served policy: success over all environments and per environment."""

    phase: str
    policy_version: int
    horizon: int
    success: float
    success_se: float
    episodes: int
    tasks: int
    seconds: float
    environments: dict[str, dict[str, Any]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The ``status.metrics`` entries of this phase."""
        prefix = f"eval/{self.phase}"
        return {
            f"{prefix}/success": round(self.success, 4),
            f"{prefix}/success_se": round(self.success_se, 4),
            f"{prefix}/episodes": float(self.episodes),
            f"{prefix}/horizon": float(self.horizon),
            f"{prefix}/seconds": round(self.seconds, 1),
            f"{prefix}/policy_version": float(self.policy_version),
        }

    @property
    def errors(self) -> int:
        """Episodes an infrastructure fault ended (counted as failures in `success`)."""
        return sum(int(env.get("errors", 0)) for env in self.environments.values())

    def describe(self) -> str:
        """``success 0.41 ± 0.05 (128 episodes, babyai test-easy, horizon 5, policy v1, 21 s)``; with
        ``, 3 ended by errors (<the most common reason>)`` after the episodes where there were any."""
        errors = f", {self.errors} ended by errors ({self.error_reason()})" if self.errors else ""
        return (
            f"success {self.success:.2f} ± {self.success_se:.2f} ({self.episodes} episodes{errors}, {self.where()}, "
            f"policy v{self.policy_version}, {self.seconds:.0f} s)"
        )

    def error_reason(self) -> str:
        """The most common reason an episode ended by an error, over all environments ("" when none did)."""
        reasons: Counter[str] = Counter()
        for env in self.environments.values():
            reasons.update({str(k): int(v) for k, v in (env.get("error_reasons") or {}).items()})
        return reasons.most_common(1)[0][0] if reasons else ""

    def where(self) -> str:
        """``babyai test-easy, horizon 5``, or with horizons per environment ``babyai test-easy (5), textcraft ...``."""
        horizons = {name: int(env.get("horizon", self.horizon)) for name, env in self.environments.items()}
        if len(set(horizons.values())) <= 1:
            splits = ", ".join(f"{name} {env['split']}" for name, env in self.environments.items())
            return f"{splits}, horizon {self.horizon}"
        return ", ".join(f"{name} {env['split']} (horizon {horizons[name]})" for name, env in self.environments.items())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PhaseResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def eval_horizon(spec: TrainingRunSpec, environment: str | None = None) -> int:
    """`environment`'s (default: the first's) horizon in the final curriculum stage (fixed: the run's horizon;
    adaptive: its maximum)."""
    curriculum = spec.curriculum
    first = spec.environments[0].name
    if curriculum.kind == "fixed":
        return int(curriculum.max_turns or spec.horizon_stages(first)[-1])
    if curriculum.kind == "adaptive":
        adaptive = curriculum.adaptive
        return int(adaptive.maximum) if adaptive is not None else int(spec.horizon_stages(first)[-1])
    return int(spec.horizon_stages(environment or first)[-1])


def combine(phase: str, version: int, horizon: int, seconds: float, per_env: dict[str, dict[str, Any]]) -> PhaseResult:
    """One result from per-environment summaries (success weighted by episodes; errors combined in quadrature)."""
    episodes = sum(int(env["episodes"]) for env in per_env.values())
    tasks = sum(int(env["tasks"]) for env in per_env.values())
    success = sum(float(env["success"]) * int(env["episodes"]) for env in per_env.values()) / max(episodes, 1)
    weights = {name: int(env["episodes"]) / max(episodes, 1) for name, env in per_env.items()}
    variance = sum((float(env["success_se"]) * weights[name]) ** 2 for name, env in per_env.items())
    return PhaseResult(phase, version, horizon, success, variance**0.5, episodes, tasks, seconds, per_env)


def eval_settings_for(
    spec: TrainingRunSpec, env: EnvironmentSpec, settings: RunEvalSettings, horizon: int
) -> EvalSettings:
    """How one environment's eval episodes are played: sampled as the run samples its rollouts."""
    from agentgym.local.evaluate import EvalSettings

    # Leave the rollout workers their episodes: the service caps live episodes at maxEpisodes.
    rollout_slots = spec.rollout.concurrency * spec.rollout.workers
    concurrency = max(1, min(spec.inference.max_batch_size, env.max_episodes - rollout_slots))
    return EvalSettings(
        environment=env.name,
        split=env.eval_split,
        tasks=settings.tasks,
        samples=settings.samples,
        max_turns=[horizon],
        temperature=spec.rollout.temperature,
        top_p=spec.rollout.top_p,
        max_tokens_per_turn=spec.rollout.max_tokens_per_turn,
        max_context_tokens=spec.model.max_context_tokens,
        concurrency=concurrency,
        seed=spec.trainer.seed,
        spread=True,
    )


async def evaluate_served_policy(
    spec: TrainingRunSpec,
    phase: str,
    policy_version: int,
    inference_url: str,
    env_urls: dict[str, str],
    chat: ChatTokenizer,
    settings: RunEvalSettings,
) -> PhaseResult:
    """Play the eval episodes of every environment against the policy inference serves now: the environments at
    once, so that the engine decodes all their episodes in one batch (each episode's seed is its own: the same
    episodes are played either way)."""
    from agentgym.local.evaluate import play_split

    async def play(env: EnvironmentSpec) -> dict[str, Any]:
        horizon = settings.horizon or eval_horizon(spec, env.name)
        eval_settings = eval_settings_for(spec, env, settings, horizon)
        results = await play_split(eval_settings, inference_url, env_urls[env.name], chat)
        return {**results["by_max_turns"][str(horizon)], "split": env.eval_split, "horizon": horizon}

    started = time.perf_counter()
    summaries = await asyncio.gather(*(play(env) for env in spec.environments))
    per_env: dict[str, dict[str, Any]] = {
        env.name: summary for env, summary in zip(spec.environments, summaries, strict=True)
    }
    first_horizon = settings.horizon or eval_horizon(spec)
    return combine(phase, policy_version, first_horizon, time.perf_counter() - started, per_env)


def write_phase(run_dir: Path, result: PhaseResult) -> Path:
    path = run_dir / "eval" / f"{result.phase}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(result), indent=2))
    return path


def load_phases(run_dir: Path) -> dict[str, PhaseResult]:
    """The phases already evaluated in ``run_dir`` (a resumed run keeps them)."""
    out: dict[str, PhaseResult] = {}
    for phase in PHASES:
        path = run_dir / "eval" / f"{phase}.json"
        if path.is_file():
            try:
                out[phase] = PhaseResult.from_dict(json.loads(path.read_text()))
            except (ValueError, TypeError, KeyError):
                continue
    return out


def paired_gain(before: PhaseResult, after: PhaseResult) -> tuple[float, float, int]:
    """The success gain in points over the tasks both phases played, with its paired standard error.

    Each task t of each environment gives d_t = after_t - before_t (its success rates); the gain is
    100 * mean(d) and its error 100 * sd(d) / sqrt(n). A task's difficulty cancels in d_t, so this error is
    the right one for "did training help" and is usually smaller than the two phases' errors combined.
    Returns (points, standard error in points, tasks compared); (nan, nan, 0) when no task is shared
    (phases written before ``task_success`` existed).
    """
    differences: list[float] = []
    for name, env_after in after.environments.items():
        tasks_after = env_after.get("task_success") or {}
        tasks_before = (before.environments.get(name) or {}).get("task_success") or {}
        differences += [float(tasks_after[t]) - float(tasks_before[t]) for t in tasks_after if t in tasks_before]
    n = len(differences)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(differences) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1) / n) if n > 1 else 0.0
    return 100.0 * mean, 100.0 * se, n


def _points(before: PhaseResult, after: PhaseResult) -> float:
    return round(100.0 * (after.success - before.success), 1)


def gains(phases: dict[str, PhaseResult]) -> dict[str, float]:
    """Success gains in points: ``total`` (start -> end), ``sft`` (start -> sft), ``rl`` (sft -> end)."""
    out: dict[str, float] = {}
    start, sft, end = phases.get("start"), phases.get("sft"), phases.get("end")
    if start and end:
        out["total"] = _points(start, end)
    if start and sft:
        out["sft"] = _points(start, sft)
    if sft and end:
        out["rl"] = _points(sft, end)
    return out


def summary_lines(phases: dict[str, PhaseResult], algorithm: str = "RL", rl_steps: int | None = None) -> list[str]:
    """The run summary: start -> end success, and what the SFT warm-up and RL each contributed."""
    start, sft, end = phases.get("start"), phases.get("sft"), phases.get("end")
    if not phases:
        return []
    lines = []
    reference = end or sft or start
    assert reference is not None
    header = f"held-out success ({reference.where()}, {reference.episodes} episodes)"
    if start and end:
        lines.append(
            f"{header}: {start.success:.2f} -> {end.success:.2f} ({_points(start, end):+.0f} pts; "
            f"± {start.success_se:.2f} / ± {end.success_se:.2f})"
        )
    else:
        lines.append(header + ": " + ", ".join(f"{p} {r.success:.2f}" for p, r in phases.items()))
    parts = []
    if start and sft:
        parts.append(f"SFT warm-up {start.success:.2f} -> {sft.success:.2f} ({_points(start, sft):+.0f} pts)")
    if sft and end:
        steps = f", {rl_steps} step{'s' if rl_steps != 1 else ''}" if rl_steps is not None else ""
        gain = _points(sft, end)
        parts.append(f"{algorithm.upper()} {sft.success:.2f} -> {end.success:.2f} ({gain:+.0f} pts{steps})")
    if parts:
        lines.append("  " + "; ".join(parts))
    return lines
