"""Horizon (max turns per episode) schedules: fixed, ScalingInter-RL stages, adaptive.

Steps are 0-based training steps. A schedule is always positioned at ``step``: the next training
step to run, whose rollouts use ``current_horizon`` as ``RolloutRequest.max_turns``. The training
loop drives every kind the same way::

    schedule = build_schedule("scaling_inter", horizons=[6, 13, 20], stage_steps=100)
    schedule.load_state_dict(checkpoint["curriculum"])            # on resume
    for step in range(schedule.step, total_steps):
        max_turns = schedule.current_horizon                      # rollouts of this step
        ...                                                       # rollouts, update
        schedule.update(step, {"success_rate": s, "truncation_rate": tr})   # -> next horizon
        publish(schedule.state())                                 # CurriculumState{step+1, ...}
        checkpoint["curriculum"] = schedule.state_dict()

``FixedHorizon`` and ``ScalingInterSchedule`` are pure functions of the step (``horizon(step)``)
and ignore metrics; ``AdaptiveHorizon`` decides from the metrics it is given. ``state_dict()`` is a
plain JSON-able dict and ``load_state_dict`` restores it exactly: a resumed schedule produces
the same future horizons as one that never stopped.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, ClassVar

from agentgym.environments import ENVIRONMENTS

__all__ = [
    "PAPER_SCALING_INTER",
    "AdaptiveHorizon",
    "CurriculumState",
    "FixedHorizon",
    "HorizonSchedule",
    "ScalingInterPreset",
    "ScalingInterSchedule",
    "build_schedule",
    "paper_preset",
]


@dataclass(frozen=True)
class CurriculumState:
    """What the trainer publishes after each step (the ``CurriculumState`` message's fields).

    ``step`` is the next training step, the one ``horizon`` applies to; ``metrics`` are those of
    the update that produced this state.
    """

    step: int
    stage: int
    horizon: int
    schedule: str
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "stage": self.stage,
            "horizon": self.horizon,
            "schedule": self.schedule,
            "metrics": dict(self.metrics),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CurriculumState:
        return cls(
            step=int(data["step"]),
            stage=int(data["stage"]),
            horizon=int(data["horizon"]),
            schedule=str(data["schedule"]),
            metrics={str(k): float(v) for k, v in dict(data.get("metrics", {})).items()},
        )


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class HorizonSchedule(ABC):
    """Base of the horizon schedules: step bookkeeping, ``update``, ``state``, state dicts."""

    kind: ClassVar[str]

    def __init__(self) -> None:
        self._step = 0
        self._last_metrics: dict[str, float] = {}

    @property
    def step(self) -> int:
        """The next training step to run; ``current_horizon`` is its horizon."""
        return self._step

    @property
    @abstractmethod
    def current_horizon(self) -> int:
        """Max turns per episode for the rollouts of training step ``self.step``."""

    @property
    @abstractmethod
    def stage(self) -> int:
        """Stage index of ``self.step`` (0-based)."""

    @abstractmethod
    def _observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """Take in the metrics of finished training step ``step`` (before ``self._step`` moves)."""

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> int:
        """Record that training step ``step`` finished with ``metrics``; return the horizon of ``step + 1``.

        ``step`` must not be below ``self.step`` (a step is not counted twice); skipping ahead is
        allowed. Metrics used by the adaptive schedule: ``success_rate`` and ``truncation_rate``.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < self._step:
            raise ValueError(f"update for step {step!r}, but the schedule is at step {self._step}")
        clean = {str(k): float(v) for k, v in (metrics or {}).items()}
        self._observe(step, clean)
        self._last_metrics = clean
        self._step = step + 1
        return self.current_horizon

    def state(self) -> CurriculumState:
        """The publishable state: next step, its stage and horizon, last metrics."""
        return CurriculumState(
            step=self._step,
            stage=self.stage,
            horizon=self.current_horizon,
            schedule=self.kind,
            metrics=dict(self._last_metrics),
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-able progress of the schedule (not its configuration)."""
        return {"kind": self.kind, "step": self._step, "last_metrics": dict(self._last_metrics)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (from a schedule of the same kind)."""
        if state.get("kind") != self.kind:
            raise ValueError(f"state of a {state.get('kind')!r} schedule given to a {self.kind!r} one")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"invalid step {step!r} in state")
        self._step = step
        self._last_metrics = {str(k): float(v) for k, v in dict(state.get("last_metrics", {})).items()}


class FixedHorizon(HorizonSchedule):
    """The same horizon at every step (the paper's fixed-turn baselines); stage is always 0."""

    kind = "fixed"

    def __init__(self, max_turns: int) -> None:
        super().__init__()
        self.max_turns = _positive_int("max_turns", max_turns)

    def horizon(self, step: int) -> int:
        """Horizon of training step ``step``."""
        return self.max_turns

    @property
    def current_horizon(self) -> int:
        return self.max_turns

    @property
    def stage(self) -> int:
        return 0

    def _observe(self, step: int, metrics: Mapping[str, float]) -> None:
        return None


@dataclass(frozen=True)
class ScalingInterPreset:
    """The paper's ScalingInter-RL settings of one environment."""

    horizons: tuple[int, ...]
    stage_steps: int


# Xi et al. 2025 (AgentGym-RL), ScalingInter-RL: horizons per stage, a new stage every
# `stage_steps` training steps (from the environment cards).
PAPER_SCALING_INTER: dict[str, ScalingInterPreset] = {
    name: ScalingInterPreset(card.horizons, card.stage_steps) for name, card in ENVIRONMENTS.items()
}
_ENV_ALIASES = {"scienceworld": "sciworld", "search": "deepsearch", "searchqa": "deepsearch"}


def paper_preset(environment: str) -> ScalingInterPreset:
    """The paper's ScalingInter-RL preset of ``environment`` (case, ``-``, ``_`` and spaces ignored)."""
    key = "".join(ch for ch in environment.lower() if ch.isalnum())
    key = _ENV_ALIASES.get(key, key)
    if key not in PAPER_SCALING_INTER:
        raise ValueError(f"no ScalingInter-RL preset for {environment!r}; known: {', '.join(PAPER_SCALING_INTER)}")
    return PAPER_SCALING_INTER[key]


class ScalingInterSchedule(HorizonSchedule):
    """ScalingInter-RL (Xi et al. 2025): the horizon grows in stages.

    Stage ``k`` has horizon ``horizons[k]``. Stage boundaries are the first steps of stages
    ``1..K-1``: ``boundaries = [stage_steps, 2 * stage_steps, ...]`` by default, or given
    explicitly (strictly increasing, ``len(horizons) - 1`` of them). Step ``s`` is in stage
    ``#{b in boundaries : b <= s}``, so with ``stage_steps=100`` steps 0..99 are stage 0, step 100
    starts stage 1, and the last stage lasts until the end of training.
    """

    kind = "scaling_inter"

    def __init__(
        self,
        horizons: Sequence[int] = (6, 13, 20),
        stage_steps: int | None = None,
        boundaries: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if not horizons:
            raise ValueError("horizons must not be empty")
        self.horizons = [_positive_int("horizon", h) for h in horizons]
        if boundaries is not None:
            if stage_steps is not None:
                raise ValueError("give stage_steps or boundaries, not both")
            bounds = [_positive_int("boundary", b) for b in boundaries]
            if any(b2 <= b1 for b1, b2 in pairwise(bounds)):
                raise ValueError(f"boundaries must increase strictly, got {bounds}")
        else:
            every = _positive_int("stage_steps", 100 if stage_steps is None else stage_steps)
            bounds = [every * k for k in range(1, len(self.horizons))]
        if len(bounds) != len(self.horizons) - 1:
            raise ValueError(f"{len(self.horizons)} horizons need {len(self.horizons) - 1} boundaries")
        self.boundaries = bounds

    @classmethod
    def paper_default(cls, environment: str) -> ScalingInterSchedule:
        """The paper's schedule for ``environment`` (see :data:`PAPER_SCALING_INTER`)."""
        preset = paper_preset(environment)
        return cls(horizons=preset.horizons, stage_steps=preset.stage_steps)

    def stage_at(self, step: int) -> int:
        """Stage index of training step ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return bisect_right(self.boundaries, step)

    def horizon(self, step: int) -> int:
        """Horizon of training step ``step``."""
        return self.horizons[self.stage_at(step)]

    @property
    def current_horizon(self) -> int:
        return self.horizon(self._step)

    @property
    def stage(self) -> int:
        return self.stage_at(self._step)

    def _observe(self, step: int, metrics: Mapping[str, float]) -> None:
        return None


class AdaptiveHorizon(HorizonSchedule):
    """Horizon driven by success and truncation statistics (beyond the paper's fixed stages).

    Each :meth:`update` appends the step's ``success_rate`` and ``truncation_rate`` (share of
    episodes cut by the horizon), both in [0, 1], to a history that only holds steps played at the
    CURRENT horizon (it is cleared when the horizon changes). With ``W = window``, ``S`` the
    success history and ``U`` the truncation history:

    Raise (the agent has stopped improving because it runs out of turns)::

        len(S) >= 2W  and  mean(S[-W:]) - mean(S[-2W:-W]) < plateau_delta      (plateau)
                      and  mean(U[-W:]) > truncation_threshold                  (truncated)
                      and  horizon < maximum

    Lower (only with ``allow_decrease``; episodes end well before the horizon and mostly succeed,
    so turns can be saved)::

        len(S) >= W  and  mean(U[-W:]) < low_truncation_threshold
                     and  mean(S[-W:]) >= high_success_threshold  and  horizon > minimum

    Hysteresis: a condition must hold on ``patience`` consecutive updates (its streak resets when it
    fails), and no change happens until ``cooldown`` steps have passed since the last change (a
    change made at ``update(c)`` allows the next one at ``update(s)`` with ``s - c >= cooldown``;
    streaks keep counting meanwhile). A raise adds ``increment``, a lowering subtracts
    ``decrement`` (default ``increment``); the horizon stays within ``[minimum, maximum]``
    (clamped). ``stage`` counts the changes made so far. After a change streaks and history reset.

    Why these signals (the paper's open problem 7: when to give the agent more turns):

    - Truncation alone is not enough: an untrained policy is truncated at any horizon (it wanders), and
      raising then is the fixed-long arm's failure, long noisy episodes the policy cannot learn from yet.
    - A plateau alone is not enough: if few episodes hit the horizon, more turns cannot help; the
      plateau is the policy's, not the budget's.
    - Both together say the horizon is what caps success now: improvement has stopped while a large share
      of episodes still ends by running out of turns.
    - The history only holds steps at the current horizon, so a change is judged on what that horizon
      did; ``patience`` filters one-step noise of small groups; ``cooldown`` gives the policy time to use
      the turns it was just given before it is judged again.
    - ``maximum`` is the budget's ceiling; a sensible one is about twice the expert's typical solution
      length, beyond which extra turns mostly buy wandering (e.g. BabyAI doors: median 6, maximum 12).
    """

    kind = "adaptive"

    def __init__(
        self,
        initial: int,
        minimum: int,
        maximum: int,
        increment: int = 5,
        window: int = 10,
        plateau_delta: float = 0.02,
        truncation_threshold: float = 0.3,
        patience: int = 3,
        cooldown: int = 50,
        allow_decrease: bool = False,
        decrement: int | None = None,
        low_truncation_threshold: float = 0.05,
        high_success_threshold: float = 0.9,
        success_key: str = "success_rate",
        truncation_key: str = "truncation_rate",
    ) -> None:
        super().__init__()
        self.minimum = _positive_int("minimum", minimum)
        self.maximum = _positive_int("maximum", maximum)
        self.initial = _positive_int("initial", initial)
        if not self.minimum <= self.initial <= self.maximum:
            raise ValueError(f"need minimum <= initial <= maximum, got {minimum}, {initial}, {maximum}")
        self.increment = _positive_int("increment", increment)
        self.decrement = _positive_int("decrement", increment if decrement is None else decrement)
        self.window = _positive_int("window", window)
        self.patience = _positive_int("patience", patience)
        if isinstance(cooldown, bool) or not isinstance(cooldown, int) or cooldown < 0:
            raise ValueError(f"cooldown must be an int >= 0, got {cooldown!r}")
        self.cooldown = cooldown
        if not 0.0 <= low_truncation_threshold < truncation_threshold <= 1.0:
            raise ValueError("need 0 <= low_truncation_threshold < truncation_threshold <= 1")
        self.plateau_delta = float(plateau_delta)
        self.truncation_threshold = float(truncation_threshold)
        self.allow_decrease = bool(allow_decrease)
        self.low_truncation_threshold = float(low_truncation_threshold)
        self.high_success_threshold = float(high_success_threshold)
        self.success_key = success_key
        self.truncation_key = truncation_key
        self._horizon = self.initial
        self._stage = 0
        self._success: list[float] = []
        self._truncation: list[float] = []
        self._raise_streak = 0
        self._lower_streak = 0
        self._last_change_step: int | None = None

    @property
    def current_horizon(self) -> int:
        return self._horizon

    @property
    def stage(self) -> int:
        return self._stage

    def _metric(self, metrics: Mapping[str, float], key: str) -> float:
        if key not in metrics:
            raise ValueError(f"adaptive horizon needs metric {key!r}, got {sorted(metrics)}")
        value = metrics[key]
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"metric {key!r} must be in [0, 1], got {value}")
        return value

    def _raise_condition(self) -> bool:
        w = self.window
        if len(self._success) < 2 * w or self._horizon >= self.maximum:
            return False
        recent = sum(self._success[-w:]) / w
        before = sum(self._success[-2 * w : -w]) / w
        truncated = sum(self._truncation[-w:]) / w
        return recent - before < self.plateau_delta and truncated > self.truncation_threshold

    def _lower_condition(self) -> bool:
        w = self.window
        if not self.allow_decrease or len(self._success) < w or self._horizon <= self.minimum:
            return False
        success = sum(self._success[-w:]) / w
        truncated = sum(self._truncation[-w:]) / w
        return truncated < self.low_truncation_threshold and success >= self.high_success_threshold

    def _observe(self, step: int, metrics: Mapping[str, float]) -> None:
        success = self._metric(metrics, self.success_key)
        truncation = self._metric(metrics, self.truncation_key)
        self._success.append(success)
        self._truncation.append(truncation)
        keep = 2 * self.window
        del self._success[:-keep], self._truncation[:-keep]
        self._raise_streak = self._raise_streak + 1 if self._raise_condition() else 0
        self._lower_streak = self._lower_streak + 1 if self._lower_condition() else 0
        cooled = self._last_change_step is None or step - self._last_change_step >= self.cooldown
        if not cooled:
            return
        if self._raise_streak >= self.patience:
            new = min(self._horizon + self.increment, self.maximum)
        elif self._lower_streak >= self.patience:
            new = max(self._horizon - self.decrement, self.minimum)
        else:
            return
        self._horizon = new
        self._stage += 1
        self._last_change_step = step
        self._success.clear()
        self._truncation.clear()
        self._raise_streak = self._lower_streak = 0

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            horizon=self._horizon,
            stage=self._stage,
            success_history=list(self._success),
            truncation_history=list(self._truncation),
            raise_streak=self._raise_streak,
            lower_streak=self._lower_streak,
            last_change_step=self._last_change_step,
        )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        horizon = int(state["horizon"])
        if not self.minimum <= horizon <= self.maximum:
            raise ValueError(f"horizon {horizon} in state is outside [{self.minimum}, {self.maximum}]")
        self._horizon = horizon
        self._stage = int(state["stage"])
        self._success = [float(x) for x in state["success_history"]]
        self._truncation = [float(x) for x in state["truncation_history"]]
        if len(self._success) != len(self._truncation):
            raise ValueError("success and truncation histories differ in length")
        self._raise_streak = int(state["raise_streak"])
        self._lower_streak = int(state["lower_streak"])
        last = state["last_change_step"]
        self._last_change_step = None if last is None else int(last)


def build_schedule(kind: str, **params: Any) -> HorizonSchedule:
    """A schedule from its kind and constructor parameters.

    ``"fixed"`` -> :class:`FixedHorizon` (``max_turns``); ``"scaling_inter"`` (or
    ``"scaling-inter"``) -> :class:`ScalingInterSchedule` (``horizons``, ``stage_steps`` or
    ``boundaries``; ``environment=`` starts from the paper preset, other parameters override it);
    ``"adaptive"`` -> :class:`AdaptiveHorizon`.
    """
    name = kind.lower().replace("-", "_")
    if name == "fixed":
        _check_parameters(FixedHorizon, kind, params)
        return FixedHorizon(**params)
    if name == "scaling_inter":
        environment = params.pop("environment", None)
        if environment is not None:
            preset = paper_preset(str(environment))
            params.setdefault("horizons", preset.horizons)
            if "boundaries" not in params:
                params.setdefault("stage_steps", preset.stage_steps)
        _check_parameters(ScalingInterSchedule, kind, params)
        return ScalingInterSchedule(**params)
    if name == "adaptive":
        _check_parameters(AdaptiveHorizon, kind, params)
        return AdaptiveHorizon(**params)
    raise ValueError(f"unknown horizon schedule {kind!r}; use fixed, scaling_inter or adaptive")


def _check_parameters(schedule: type[HorizonSchedule], kind: str, params: Mapping[str, Any]) -> None:
    """A ValueError naming the unknown keys (a bare TypeError from the constructor names no schedule)."""
    accepted = set(inspect.signature(schedule).parameters) - {"self"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        takes = ", ".join(sorted(accepted))
        raise ValueError(f"horizon schedule {kind!r}: unknown parameter(s) {', '.join(unknown)}; it takes {takes}")
