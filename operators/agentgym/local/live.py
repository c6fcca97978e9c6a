"""What a person watches during `agentgym run`: a live panel (TTY) and one summary line per step."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

from agentgym.spec import TrainingRunStatus

# Keys of the trainer's step metrics shown in the panel, with their labels (first present wins).
SHOWN: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward/mean", "reward_mean")),
    ("success", ("success_rate",)),
    ("turns", ("turns/mean", "turns_mean")),
    ("truncated", ("truncation_rate",)),
    ("failed", ("failed_rate",)),
    ("episodes/s", ("episodes_per_s", "episodes_per_second")),
    ("tokens/s", ("tokens_per_s", "tokens_per_second")),
]


def pick(metrics: dict[str, float], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if key in metrics:
            return metrics[key]
        for name, value in metrics.items():  # per-environment keys end with the metric name
            if name.endswith("/" + key):
                return value
    return None


def eta_seconds(status: TrainingRunStatus, total_steps: int, started: float, first_step: int) -> float | None:
    done = status.step - first_step
    if done <= 0:
        return None
    per_step = (time.time() - started) / done
    return per_step * max(total_steps - status.step, 0)


def step_line(status: TrainingRunStatus, total_steps: int, eta: float | None) -> str:
    parts = [f"step {status.step}/{total_steps}", f"horizon {status.horizon}", f"policy v{status.policy_version}"]
    for label, keys in SHOWN:
        value = pick(status.metrics, keys)
        if value is not None:
            parts.append(f"{label} {value:.3g}")
    if eta is not None:
        parts.append(f"ETA {eta / 60:.1f} min")
    return " | ".join(parts)


EVAL_PHASES = {"start": "before training", "sft": "after SFT warm-up", "end": "final policy"}


def eval_line(phase: str, metrics: dict[str, float]) -> str | None:
    """``eval (before training): success 0.00 ± 0.00, 128 episodes, horizon 5, 21 s``; None before it ran."""
    prefix = f"eval/{phase}"
    if f"{prefix}/success" not in metrics:
        return None
    return (
        f"eval ({EVAL_PHASES.get(phase, phase)}): success {metrics[f'{prefix}/success']:.2f} "
        f"± {metrics.get(f'{prefix}/success_se', 0.0):.2f}, {metrics.get(f'{prefix}/episodes', 0):.0f} episodes, "
        f"horizon {metrics.get(f'{prefix}/horizon', 0):.0f}, {metrics.get(f'{prefix}/seconds', 0):.0f} s"
    )


def panel(name: str, status: TrainingRunStatus, total_steps: int, eta: float | None) -> Table:
    table = Table(title=f"agentgym run: {name}  [{status.phase}]", show_header=False, expand=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("step", f"{status.step} / {total_steps}")
    table.add_row("horizon (stage)", f"{status.horizon} ({status.stage})")
    table.add_row("policy", f"v{status.policy_version} (served v{status.served_policy_version})")
    for label, keys in SHOWN:
        value = pick(status.metrics, keys)
        table.add_row(label, "-" if value is None else f"{value:.4g}")
    table.add_row("ETA", "-" if eta is None else f"{eta / 60:.1f} min")
    for phase, label in EVAL_PHASES.items():
        key = f"eval/{phase}/success"
        if key in status.metrics:
            se = status.metrics.get(f"eval/{phase}/success_se", 0.0)
            table.add_row(f"eval: {label}", f"{status.metrics[key]:.2f} ± {se:.2f}")
    conditions = ", ".join(f"{c.type}={c.status}" for c in status.conditions)
    table.add_row("conditions", conditions or "-")
    return table


class Progress:
    """Renders status changes: a live panel on a terminal, plain lines otherwise (and always to the log)."""

    def __init__(self, name: str, total_steps: int, console: Console, log_path: Any) -> None:
        self.name = name
        self.total_steps = total_steps
        self.console = console
        self.log_path = log_path
        self.started = time.time()
        self.first_step: int | None = None
        self.last_logged_step = -1
        self.logged_evals: set[str] = set()
        self.live: Any = None

    def _log(self, line: str) -> None:
        with open(self.log_path, "a") as handle:
            handle.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        if self.live is None:
            self.console.print(line, soft_wrap=True)

    def update(self, status: TrainingRunStatus) -> None:
        if self.first_step is None:
            self.first_step = status.step
        eta = eta_seconds(status, self.total_steps, self.started, self.first_step)
        if status.step != self.last_logged_step and status.horizon is not None:
            self.last_logged_step = status.step
            self._log(step_line(status, self.total_steps, eta))
        for phase in EVAL_PHASES:
            line = eval_line(phase, status.metrics) if phase not in self.logged_evals else None
            if line is not None:
                self.logged_evals.add(phase)
                self._log(line)
        if self.live is not None:
            self.live.update(panel(self.name, status, self.total_steps, eta))
