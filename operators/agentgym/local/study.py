"""Studies: one base TrainingRun, arms that override parts of it, and seeds; every arm x seed is one run.

A study document (`kind: Study`, see `examples/study-horizons.yaml`)::

    spec:
      base: quickstart.yaml          # a TrainingRun file (relative to the study file) or an inline document
      seeds: [1, 2, 3]
      arms:
        - name: fixed-short
          overrides: {curriculum: {kind: fixed, maxTurns: 4}}

The budget is the base's and the same for every arm: `trainer.totalSteps` RL steps of `rollout.tasksPerStep` tasks x
`algorithm.groupSize` samples, so every arm trains on the same number of episodes with the same number of updates
(the paper's Fig. 7 compares its arms at equal training steps). An arm may not override those fields, nor
`trainer.seed` (the study sets it): refused naming the field. What the budget buys in environment steps and wall time
differs by arm (a longer horizon plays more turns) and is reported per arm.

With an SFT warm-up in the base, the arms of a seed share one (`sharedWarmup`, on by default then): the study runs
`agentgym sft` once per seed into `<study dir>/warmup/seed-<n>` and every arm of that seed starts RL from that policy
(`model.name` the warm-up's checkpoint, `trainer.sftWarmupSteps` 0). The arms are then compared from the same start,
a paired design (the warm-up's own run-to-run spread is not mixed into the differences between arms), and the study
does a third less work. An arm may then override only what the warm-up does not read (`curriculum`, `algorithm`,
`rollout`, `inference`): anything else is refused naming the field.

Locally (`agentgym study`) the members run one after another, seed-major (every arm's seed 1, then seed 2, ...) so a
study stopped half way is balanced across arms; each lives in `<study dir>/<arm>/seed-<n>` and a rerun skips the
finished ones and resumes a half-finished one from its checkpoint. On a cluster, `--emit DIR` writes one TrainingRun
per member labelled `agentgym.io/study`, `agentgym.io/arm`, `agentgym.io/seed` for `kubectl apply -f DIR`.
`study_report` puts the arms side by side with standard errors over seeds.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agentgym.spec import (
    SpecError,
    SpecModel,
    TrainingRun,
    format_validation_error,
    parse_training_run,
    read_document,
)

STUDY_FILE = "study.yaml"
STUDY_LABEL, ARM_LABEL, SEED_LABEL = "agentgym.io/study", "agentgym.io/arm", "agentgym.io/seed"
BUDGET_FIELDS: tuple[tuple[str, str], ...] = (
    ("trainer", "totalSteps"),
    ("rollout", "tasksPerStep"),
    ("algorithm", "groupSize"),
)
STUDY_SET_FIELDS: tuple[tuple[str, str], ...] = (("trainer", "seed"),)
WARMUP_FREE_SECTIONS = ("curriculum", "algorithm", "rollout", "inference")
"""What an arm may override when its seed's warm-up is shared: parts of the spec the SFT warm-up does not read (it
reads the model, the environments and their tasks, the trainer's settings and the seed)."""
WARMUP_DIR = "warmup"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ArmSpec(SpecModel):
    name: str = Field(min_length=1, max_length=24, pattern=NAME_PATTERN)
    """DNS-label-like: it names run directories and TrainingRuns."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Parts of the base's `spec` this arm replaces (merged key by key; lists are replaced whole)."""


class StudySpec(SpecModel):
    base: str | dict[str, Any]
    """A TrainingRun file (relative to the study file) or an inline TrainingRun document."""
    seeds: list[int] = Field(min_length=1, max_length=32)
    arms: list[ArmSpec] = Field(min_length=1, max_length=16)
    eval_max_turns: int | None = Field(default=None, ge=1)
    """Max turns of every member's held-out evals, the same for all arms (default: the longest final horizon)."""
    eval_tasks: int = Field(default=100, ge=1)
    """Held-out tasks each eval plays (before training, after a warm-up, at the end)."""
    shared_warmup: bool | None = None
    """One SFT warm-up per seed, shared by the arms (default: on when the base has `trainer.sftWarmupSteps`)."""

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct, got {seeds}")
        return seeds

    @field_validator("arms")
    @classmethod
    def _distinct_arms(cls, arms: list[ArmSpec]) -> list[ArmSpec]:
        names = [arm.name for arm in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be distinct, got {names}")
        return arms


class StudyMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=24, pattern=NAME_PATTERN)


class StudyDocument(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["agentgym.io/v1alpha1"] = Field(default="agentgym.io/v1alpha1", alias="apiVersion")
    kind: Literal["Study"] = "Study"
    metadata: StudyMeta
    spec: StudySpec


@dataclass(frozen=True)
class Member:
    """One arm x seed: its TrainingRun and where it runs."""

    arm: str
    seed: int
    run: TrainingRun

    @property
    def directory(self) -> str:
        return f"{self.arm}/seed-{self.seed}"


@dataclass(frozen=True)
class Study:
    name: str
    base: dict[str, Any]
    arms: list[ArmSpec]
    seeds: list[int]
    members: list[Member]
    eval_max_turns: int
    eval_tasks: int
    shared_warmup: bool = False

    @property
    def episodes_per_run(self) -> int:
        spec = self.members[0].run.spec
        return spec.trainer.total_steps * spec.rollout.tasks_per_step * spec.algorithm.group_size

    def document(self) -> dict[str, Any]:
        """The study as run (the base inlined), written to `<study dir>/study.yaml`."""
        return {
            "apiVersion": "agentgym.io/v1alpha1",
            "kind": "Study",
            "metadata": {"name": self.name},
            "spec": {
                "base": self.base,
                "seeds": list(self.seeds),
                "arms": [arm.model_dump(by_alias=True, exclude_none=True) for arm in self.arms],
                "evalMaxTurns": self.eval_max_turns,
                "evalTasks": self.eval_tasks,
                "sharedWarmup": self.shared_warmup,
            },
        }


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in: mappings key by key, anything else (lists too) replaced."""
    merged = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def member_name(study: str, arm: str, seed: int) -> str:
    return f"{study}-{arm}-s{seed}"


def _base_document(base: str | dict[str, Any], source_dir: Path) -> dict[str, Any]:
    if isinstance(base, dict):
        return copy.deepcopy(base)
    path = (source_dir / base).resolve()
    try:
        document = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError([f"spec.base: {path} does not exist"], "Study") from None
    except yaml.YAMLError as error:
        raise SpecError([f"spec.base: {path} is not YAML: {error}"], "Study") from None
    if not isinstance(document, dict):
        raise SpecError([f"spec.base: {path} holds no TrainingRun document"], "Study")
    return document


def parse_study(document: Any, source_dir: Path = Path("."), source: str = "Study") -> Study:
    """Validate a study and expand it into its members; raises SpecError naming every bad field."""
    if not isinstance(document, dict):
        raise SpecError([f"(document): expected a mapping, got {type(document).__name__}"], source)
    try:
        parsed = StudyDocument.model_validate(document)
    except ValidationError as error:
        raise SpecError(format_validation_error(error), source) from None
    base = _base_document(parsed.spec.base, source_dir)
    try:
        base_run = parse_training_run(base, "the study's base")
    except SpecError as error:
        raise SpecError([f"spec.base: {line}" for line in error.errors], source) from None
    errors: list[str] = []
    members: list[Member] = []
    runs: dict[tuple[str, int], TrainingRun] = {}
    warmup_steps = base_run.spec.trainer.sft_warmup_steps
    shared_warmup = parsed.spec.shared_warmup if parsed.spec.shared_warmup is not None else warmup_steps > 0
    if shared_warmup and warmup_steps == 0:
        errors.append("spec.sharedWarmup: the base has no warm-up to share (its trainer.sftWarmupSteps is 0)")
    for index, arm in enumerate(parsed.spec.arms):
        where = f"spec.arms[{index}] ({arm.name})"
        if shared_warmup:
            for section in sorted(set(arm.overrides) - set(WARMUP_FREE_SECTIONS)):
                errors.append(
                    f"{where}.overrides.{section}: the arms of a seed share one SFT warm-up (spec.sharedWarmup), which"
                    f" reads {section}; override only {', '.join(WARMUP_FREE_SECTIONS)}, or set sharedWarmup: false"
                )
        for section, field in (*BUDGET_FIELDS, *STUDY_SET_FIELDS):
            if field in (arm.overrides.get(section) or {}):
                why = "the study sets it per seed" if (section, field) in STUDY_SET_FIELDS else (
                    "the budget is the base's, the same for every arm (set it in the base)"
                )  # fmt: skip
                errors.append(f"{where}.overrides.{section}.{field}: an arm cannot override it: {why}")
        for seed in parsed.spec.seeds:
            spec = deep_merge(base_run.to_document()["spec"], arm.overrides)
            spec.setdefault("trainer", {})["seed"] = seed
            labels = {STUDY_LABEL: parsed.metadata.name, ARM_LABEL: arm.name, SEED_LABEL: str(seed)}
            run_document = {
                "apiVersion": "agentgym.io/v1alpha1",
                "kind": "TrainingRun",
                "metadata": {"name": member_name(parsed.metadata.name, arm.name, seed), "labels": labels},
                "spec": spec,
            }
            try:
                runs[(arm.name, seed)] = parse_training_run(run_document)
            except SpecError as error:
                errors += [f"{where}: {line}" for line in error.errors if f"{where}: {line}" not in errors]
                continue
            unmet = _budget_unmet(runs[(arm.name, seed)], where)
            if unmet and unmet not in errors:
                errors.append(unmet)
    if errors:
        raise SpecError(errors, source)
    for seed in parsed.spec.seeds:  # seed-major: a study stopped half way is balanced across arms
        for arm in parsed.spec.arms:
            members.append(Member(arm.name, seed, runs[(arm.name, seed)]))
    from agentgym.local.run_eval import eval_horizon

    # One eval horizon for every arm: a fixed short arm is not judged on fewer turns than the others.
    horizons = [eval_horizon(m.run.spec, e.name) for m in members for e in m.run.spec.environments]
    max_turns = parsed.spec.eval_max_turns or max(horizons)
    return Study(
        parsed.metadata.name, base_run.to_document(), list(parsed.spec.arms), list(parsed.spec.seeds), members,
        max_turns, parsed.spec.eval_tasks, shared_warmup,
    )  # fmt: skip


def _budget_unmet(run: TrainingRun, where: str) -> str | None:
    """A ScalingInter schedule whose last stage starts only after the budget's last step is never trained at."""
    curriculum, spec = run.spec.curriculum, run.spec
    if curriculum.kind != "scaling_inter":
        return None
    environment = spec.environments[0].name
    stages, per_stage = curriculum.horizon_stages(environment), curriculum.steps_per_stage(environment)
    last_starts = (len(stages) - 1) * per_stage
    if last_starts < spec.trainer.total_steps:
        return None
    return (
        f"{where}.overrides.curriculum.stageSteps: the last stage (horizon {stages[-1]}) starts at step {last_starts},"
        f" past the budget of {spec.trainer.total_steps} steps: fewer or shorter stages"
    )


def load_study(path: str | Path) -> Study:
    path = Path(path)
    return parse_study(read_document(path), path.parent, str(path))


MemberState = Literal["done", "partial", "new"]


def member_state(run_dir: Path) -> MemberState:
    """done: the run succeeded; partial: it started (a spec and a status) but did not finish; new: nothing yet."""
    status_path = run_dir / "status.json"
    if status_path.exists():
        try:
            phase = json.loads(status_path.read_text()).get("phase")
        except json.JSONDecodeError:
            phase = None
        if phase == "Succeeded":
            return "done"
    return "partial" if (run_dir / "spec.yaml").exists() else "new"


def has_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.iterdir())


def member_command(study: Study, run_dir: Path, spec_path: Path, resume: bool) -> list[str]:
    """The `agentgym run` arguments of a member (with --resume to continue one from its checkpoint)."""
    command = ["run", str(spec_path), "--run-dir", str(run_dir), "--no-live"]
    command += ["--eval-max-turns", str(study.eval_max_turns), "--eval-tasks", str(study.eval_tasks)]
    if resume:
        command.append("--resume")
    return command


def warmed_up_policy(warmup_dir: Path) -> Path | None:
    """The policy a finished `agentgym sft` left in `warmup_dir` (its step-0 checkpoint, an HF folder), or None."""
    policy = warmup_dir / "checkpoints" / "step-0"
    try:
        state = json.loads((policy / "trainer_state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return policy if state.get("sft_done") is True else None


def warm_started(run: TrainingRun, policy: Path) -> TrainingRun:
    """`run` starting RL from a shared warm-up's policy: that folder as the model, no warm-up of its own."""
    document = run.to_document()
    spec = document["spec"]
    spec["model"]["name"] = str(policy.resolve())
    spec["trainer"]["sftWarmupSteps"] = 0
    return parse_training_run(document)


def _shared_warmup(
    study: Study, study_dir: Path, member: Member, run: Callable[[list[str]], int], say: Callable[[str], None]
) -> Path | None:
    """The seed's warm-up policy, made by `agentgym sft` on the seed's spec if it is not there yet (None: failed).
    The arms' overrides are all outside what the warm-up reads, so any member's spec makes the same warm-up."""
    warmup_dir = study_dir / WARMUP_DIR / f"seed-{member.seed}"
    policy = warmed_up_policy(warmup_dir)
    if policy is not None:
        return policy
    if warmup_dir.exists():  # an `agentgym sft` stopped half way saves nothing: start it again
        _clear(warmup_dir)
    warmup_dir.mkdir(parents=True, exist_ok=True)
    document = member.run.to_document()
    document["metadata"] = {
        "name": f"{study.name}-warmup-s{member.seed}",
        "labels": {STUDY_LABEL: study.name, SEED_LABEL: str(member.seed)},
    }
    spec_path = warmup_dir.parent / f"seed-{member.seed}.yaml"
    spec_path.write_text(yaml.safe_dump(document, sort_keys=False))
    say(f"warm-up of seed {member.seed}: starting (shared by {len(study.arms)} arms)")
    code = run(["sft", str(spec_path), "--output-dir", str(warmup_dir)])
    policy = warmed_up_policy(warmup_dir)
    say(f"warm-up of seed {member.seed}: {'done' if policy is not None else 'failed'} (exit {code})")
    return policy


def _clear(run_dir: Path) -> None:
    for leftover in sorted(run_dir.rglob("*"), reverse=True):
        if leftover.is_dir() and not leftover.is_symlink():
            leftover.rmdir()
        else:
            leftover.unlink()


def run_study(
    study: Study,
    study_dir: Path,
    run: Callable[[list[str]], int],
    say: Callable[[str], None] = print,
) -> dict[str, MemberState | Literal["failed"]]:
    """Run every member not done yet, in order; `run(args)` runs `agentgym ARGS` and returns its exit code."""
    study_dir.mkdir(parents=True, exist_ok=True)
    (study_dir / STUDY_FILE).write_text(yaml.safe_dump(study.document(), sort_keys=False))
    outcome: dict[str, MemberState | Literal["failed"]] = {}
    warmups: dict[int, Path | None] = {}
    for index, member in enumerate(study.members, start=1):
        run_dir = study_dir / member.directory
        state = member_state(run_dir)
        label = f"[{index}/{len(study.members)}] {member.directory}"
        if state == "done":
            say(f"{label}: done, skipped")
            outcome[member.directory] = "done"
            continue
        member_run = member.run
        if study.shared_warmup:
            if member.seed not in warmups:  # once per seed and invocation: a failed warm-up is not retried per arm
                warmups[member.seed] = _shared_warmup(study, study_dir, member, run, say)
            policy = warmups[member.seed]
            if policy is None:
                say(f"{label}: failed (no warm-up for seed {member.seed})")
                outcome[member.directory] = "failed"
                continue
            member_run = warm_started(member.run, policy)
        resume = state == "partial" and has_checkpoint(run_dir)
        if not resume and run_dir.exists():
            # Stopped before its first checkpoint (or while starting): nothing to continue from, start afresh.
            _clear(run_dir)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        spec_path = run_dir.parent / f"seed-{member.seed}.yaml"
        spec_path.write_text(yaml.safe_dump(member_run.to_document(), sort_keys=False))
        say(f"{label}: {'resuming' if resume else 'starting'}")
        code = run(member_command(study, run_dir, spec_path, resume))
        outcome[member.directory] = "done" if code == 0 and member_state(run_dir) == "done" else "failed"
        say(f"{label}: {outcome[member.directory]} (exit {code})")
    return outcome


def emit_cluster_runs(study: Study, out_dir: Path) -> list[Path]:
    """One TrainingRun YAML per member, labelled with the study, for `kubectl apply -f out_dir`. Each warms itself
    up on a cluster (a warm-up shared through a volume is not set up there)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for member in study.members:
        path = out_dir / f"{member.run.metadata.name}.yaml"
        path.write_text(yaml.safe_dump(member.run.to_document(), sort_keys=False))
        paths.append(path)
    return paths


# -- the report ----------------------------------------------------------------------------------------------------

CURVES: tuple[tuple[str, str, str], ...] = (
    ("success_rate", "env", "success rate"),
    ("reward_mean", "env", "reward (mean)"),
    ("turns_mean", "env", "turns used"),
    ("truncation_rate", "env", "truncated (hit the horizon)"),
    ("invalid_action_rate", "env", "invalid actions"),
    ("entropy", "top", "entropy"),
)


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error over seeds (s / sqrt(n), sample deviation; None for a single seed)."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan, None
    if len(finite) == 1:
        return finite[0], None
    return statistics.fmean(finite), statistics.stdev(finite) / math.sqrt(len(finite))


def _rl_rows(run_dir: Path) -> list[dict[str, Any]]:
    from agentgym.local.report import read_metrics

    return [row for row in read_metrics(run_dir) if "policy_loss" in row or "horizon" in row]


def _value(row: Mapping[str, Any], key: str, where: str) -> float:
    source = row.get("env", {}).get("all", {}) if where == "env" else row
    value = source.get(key) if isinstance(source, Mapping) else None
    return float(value) if isinstance(value, int | float) else math.nan


@dataclass
class MemberFigures:
    arm: str
    seed: int
    end_success: float
    warmup_success: float
    """The policy RL started from: the member's `sft` eval, or its `start` eval when it began from a shared warm-up."""
    steps: list[int]
    curves: dict[str, list[float]]
    horizons: list[float]
    environment_steps: float
    train_seconds: float


def member_figures(member_dir: Path, arm: str, seed: int, shared_warmup: bool = False) -> MemberFigures:
    rows = _rl_rows(member_dir)
    summary_path = member_dir / "eval" / "summary.json"
    end = warmup = math.nan
    seconds: dict[str, float] = {}
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        phases = summary.get("phases", {})
        end = float(phases.get("end", {}).get("success", math.nan))
        warmup = float(phases.get("start" if shared_warmup else "sft", {}).get("success", math.nan))
        seconds = summary.get("seconds", {})
    # Environment steps: every turn of every episode trained on (trajectories x mean turns, per step).
    environment_steps = sum(_value(r, "trajectories", "env") * _value(r, "turns_mean", "env") for r in rows)
    return MemberFigures(
        arm=arm,
        seed=seed,
        end_success=end,
        warmup_success=warmup,
        steps=[int(r["step"]) for r in rows],
        curves={key: [_value(r, key, where) for r in rows] for key, where, _ in CURVES},
        horizons=[_value(r, "horizon", "top") for r in rows],
        environment_steps=environment_steps,
        train_seconds=float(seconds.get("trainer_done", math.nan)) - float(seconds.get("trainer_started", math.nan)),
    )


def study_report(study_dir: Path, out_dir: Path | None = None) -> dict[str, Any]:
    """The arms side by side: a table (end success ± s.e. over seeds, environment steps, training time) and the
    per-step curves (mean ± s.e. over seeds) of success, reward, turns vs horizon, truncation, invalid actions,
    entropy. Writes `<out>/study.png`, `<out>/summary.txt`, `<out>/summary.json`; returns the summary."""
    document = yaml.safe_load((study_dir / STUDY_FILE).read_text())
    arms = [arm["name"] for arm in document["spec"]["arms"]]
    seeds = list(document["spec"]["seeds"])
    shared_warmup = bool(document["spec"].get("sharedWarmup", False))
    figures: dict[str, list[MemberFigures]] = {arm: [] for arm in arms}
    unfinished: dict[str, list[int]] = {arm: [] for arm in arms}
    for arm in arms:
        for seed in seeds:
            member_dir = study_dir / arm / f"seed-{seed}"
            state = member_state(member_dir)
            if state == "done":
                figures[arm].append(member_figures(member_dir, arm, seed, shared_warmup))
            elif state == "partial":  # a run half-way would mix a shorter budget into the arm's figures
                unfinished[arm].append(seed)
    table = []
    for arm in arms:
        members = figures[arm]
        success, success_se = mean_se([m.end_success for m in members])
        warmup, warmup_se = mean_se([m.warmup_success for m in members])
        env_steps, env_steps_se = mean_se([m.environment_steps for m in members])
        seconds, _ = mean_se([m.train_seconds for m in members])
        table.append({
            "arm": arm, "seeds": len(members), "end_success": success, "end_success_se": success_se,
            "warmup_success": warmup, "warmup_success_se": warmup_se,
            "environment_steps": env_steps, "environment_steps_se": env_steps_se, "train_seconds": seconds,
            "per_seed": {m.seed: m.end_success for m in members}, "unfinished": unfinished[arm],
        })  # fmt: skip
    curves = {arm: _mean_curves(figures[arm]) for arm in arms}
    out = out_dir or study_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = {"study": document["metadata"]["name"], "arms": table, "curves": curves}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    text = _table_text(summary["study"], table)
    (out / "summary.txt").write_text(text + "\n")
    _plot(out / "study.png", curves)
    return {"summary": summary, "text": text, "figure": out / "study.png"}


def _mean_curves(members: list[MemberFigures]) -> dict[str, Any]:
    """Per step: mean and s.e. over the seeds that reached it."""
    steps = sorted({step for m in members for step in m.steps})
    result: dict[str, Any] = {"steps": steps}
    keys = [key for key, _, _ in CURVES] + ["horizon"]
    for key in keys:
        means, errors = [], []
        for step in steps:
            values = []
            for m in members:
                if step in m.steps:
                    series = m.horizons if key == "horizon" else m.curves[key]
                    values.append(series[m.steps.index(step)])
            mean, se = mean_se(values)
            means.append(mean)
            errors.append(se)
        result[key] = {"mean": means, "se": errors}
    return result


def _format(mean: float, se: float | None, digits: int = 2) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def _table_text(name: str, table: list[dict[str, Any]]) -> str:
    lines = [f"study {name}: held-out success at the end (mean ± s.e. over seeds)", ""]
    lines.append(
        f"{'arm':24s} {'seeds':>5s}  {'after warm-up':>14s}  {'end success':>14s}  {'env steps':>16s}  {'train s':>8s}"
        "  per seed (end)"
    )
    for row in table:
        per_seed = ", ".join(f"{seed}: {value:.2f}" for seed, value in row["per_seed"].items())
        lines.append(
            f"{row['arm']:24s} {row['seeds']:5d}  {_format(row['warmup_success'], row['warmup_success_se']):>14s}  "
            f"{_format(row['end_success'], row['end_success_se']):>14s}  "
            f"{_format(row['environment_steps'], row['environment_steps_se'], 0):>16s}  "
            f"{_format(row['train_seconds'], None, 0):>8s}  {per_seed}"
        )
    left_out = [f"{row['arm']} seed {seed}" for row in table for seed in row["unfinished"]]
    if left_out:
        lines += ["", f"unfinished (left out): {', '.join(left_out)}"]
    return "\n".join(lines)


def _plot(path: Path, curves: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for axis, (key, _, title) in zip(axes.flat, CURVES, strict=True):
        for arm, curve in curves.items():
            steps = curve["steps"]
            mean = curve[key]["mean"]
            line = axis.plot(steps, mean, label=arm)[0]
            se = [e if e is not None else 0.0 for e in curve[key]["se"]]
            axis.fill_between(
                steps, [m - e for m, e in zip(mean, se, strict=True)], [m + e for m, e in zip(mean, se, strict=True)],
                color=line.get_color(), alpha=0.2,
            )  # fmt: skip
            if key == "turns_mean":
                axis.plot(steps, curve["horizon"]["mean"], "--", color=line.get_color(), alpha=0.6)
        axis.set_title(title + (" (dashed: horizon)" if key == "turns_mean" else ""))
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
