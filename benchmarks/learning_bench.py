"""Learning benchmark per environment: does the environment's CPU recipe learn, by how much, and how fast?

Runs `agentgym run <recipe> --no-live` once per seed (the recipe with `trainer.seed` set; each in a fresh run
directory), one after another, and prints as it goes each run's held-out success before training, after the SFT
warm-up and at the end, with standard errors over the held-out tasks. Before and after are the same tasks of
the same run (paired): the gain's standard error is the paired one over tasks. At the end: the gain per seed,
its mean and standard error over seeds, the wall time, the machine's load, and the target:

  textcraft, webarena   held-out success +20 points or more (start -> end) within 15 minutes, in 3 of 4 seeds
  babyai                the quickstart's: +30 points within 10 minutes
  other environments    no target: the measured change is reported

A recipe with several environments (`--env babyai+textcraft`, or `--spec`) also prints each environment's
success and paired gain.

Usage: python benchmarks/learning_bench.py --env textcraft [--seeds 1,2,3,4] [--spec FILE] [--keep DIR]
                                          [--eval-tasks N]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from quickstart_bench import load_note  # benchmarks/ is on sys.path: the script's own folder

from agentgym.local.run_eval import PhaseResult, paired_gain

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]
ROOT = Path(__file__).resolve().parents[1]
RECIPES: dict[str, Path] = {
    "babyai": ROOT / "examples" / "quickstart.yaml",
    "textcraft": ROOT / "examples" / "textcraft-cpu.yaml",
    "webarena": ROOT / "examples" / "webarena-cpu.yaml",
    "sciworld": ROOT / "examples" / "sciworld-cpu.yaml",
    "deepsearch": ROOT / "examples" / "deepsearch-cpu.yaml",
    "babyai+textcraft": ROOT / "examples" / "babyai-textcraft-cpu.yaml",  # one policy on both
}
# Held-out tasks each eval plays (`agentgym run --eval-tasks`): fewer where an episode is expensive (a browser).
EVAL_TASKS: dict[str, int] = {
    "textcraft": 48,
    "webarena": 48,
    "sciworld": 48,
    "deepsearch": 28,
    "babyai+textcraft": 48,  # each
}


@dataclass(frozen=True)
class Target:
    points: float
    minutes: float
    seeds_needed: int | None  # out of the seeds run; None: all of them


TARGETS: dict[str, Target] = {
    "babyai": Target(points=30.0, minutes=10.0, seeds_needed=None),
    "textcraft": Target(points=20.0, minutes=15.0, seeds_needed=3),
    "webarena": Target(points=20.0, minutes=15.0, seeds_needed=3),
}


@dataclass
class SeedResult:
    seed: int
    wall_s: float
    phases: dict[str, PhaseResult]
    gain: tuple[float, float, int]  # start -> end: points, paired s.e., tasks


def seeded_spec(recipe: Path, seed: int, out: Path) -> Path:
    """The recipe with `trainer.seed` set and the seed in its name (its run directory is its own)."""
    document = yaml.safe_load(recipe.read_text())
    document["metadata"]["name"] = f"{document['metadata']['name']}-seed{seed}"
    document["spec"].setdefault("trainer", {})["seed"] = seed
    path = out / f"seed-{seed}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def run_seed(recipe: Path, seed: int, work: Path, eval_tasks: int) -> SeedResult:
    spec = seeded_spec(recipe, seed, work)
    run_dir = work / f"seed-{seed}"
    started = time.perf_counter()
    result = subprocess.run(
        [*AGENTGYM, "run", str(spec), "--run-dir", str(run_dir), "--no-live", "--eval-tasks", str(eval_tasks)],
        cwd=ROOT,
        text=True,
        capture_output=True,
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:], sep="\n")
        raise SystemExit(f"seed {seed}: agentgym run failed with exit code {result.returncode}; run dir {run_dir}")
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    phases = {name: PhaseResult.from_dict(data) for name, data in summary["phases"].items()}
    if "start" not in phases or "end" not in phases:
        raise SystemExit(f"seed {seed}: the run has no start and end evaluations ({sorted(phases)}); run dir {run_dir}")
    return SeedResult(seed, wall, phases, paired_gain(phases["start"], phases["end"]))


def phase_text(phase: PhaseResult | None) -> str:
    return "     -      " if phase is None else f"{phase.success:.3f} ± {phase.success_se:.3f}"


def seed_line(result: SeedResult) -> str:
    points, se, tasks = result.gain
    phases = result.phases
    return (
        f"seed {result.seed:>3}  start {phase_text(phases.get('start'))}  sft {phase_text(phases.get('sft'))}  "
        f"end {phase_text(phases.get('end'))}  gain {points:+5.1f} ± {se:4.1f} pts ({tasks} tasks)  "
        f"{result.wall_s / 60:.1f} min" + errors_text(result)
    )


def errors_text(result: SeedResult) -> str:
    """``  ERRORS start 36/48, sft 48/48``: eval episodes an infrastructure fault ended (they count as failures,
    so a success rate beside them measures the service, not the policy); empty when there were none."""
    faulty = [f"{name} {phase.errors}/{phase.episodes}" for name, phase in result.phases.items() if phase.errors]
    return f"  ERRORS {', '.join(faulty)}" if faulty else ""


def environment_lines(result: SeedResult) -> list[str]:
    """Per-environment start -> after SFT -> end success, and the paired gain, of a run with several environments."""
    start, end = result.phases["start"], result.phases["end"]
    if len(end.environments) < 2:
        return []
    lines = []
    for name, env_end in end.environments.items():
        only = {
            phase: replace(result.phases[phase], environments={name: result.phases[phase].environments[name]})
            for phase in ("start", "end")
        }
        points, se, tasks = paired_gain(only["start"], only["end"])
        env_start = start.environments.get(name, {})
        env_sft = result.phases["sft"].environments.get(name, {}) if "sft" in result.phases else {}
        lines.append(
            f"          {name:<10} {env_start.get('split', '?'):<14} {float(env_start.get('success', math.nan)):.3f}"
            f" -> sft {float(env_sft.get('success', math.nan)):.3f} -> {float(env_end['success']):.3f}"
            f" ± {float(env_end['success_se']):.3f}  gain {points:+5.1f} ± {se:4.1f} pts ({tasks} tasks)"
        )
    return lines


def verdict(env: str, results: list[SeedResult]) -> str:
    target = TARGETS.get(env)
    if target is None:
        return "no target for this environment: the measured change is above"
    passed = [r.seed for r in results if r.gain[0] >= target.points and r.wall_s <= 60 * target.minutes]
    needed = target.seeds_needed if target.seeds_needed is not None else len(results)
    needed = min(needed, len(results))
    ok = len(passed) >= needed
    return (
        f"target: >= +{target.points:.0f} pts within {target.minutes:.0f} min in {needed} of {len(results)} seeds: "
        f"{len(passed)} passed (seeds {passed or '-'}): {'PASS' if ok else 'FAIL'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help=f"Environment (or recipe) to train on: {', '.join(RECIPES)}")
    parser.add_argument("--seeds", default="1,2,3,4", help="Comma-separated trainer seeds, run one after another")
    parser.add_argument("--spec", type=Path, default=None, help="Recipe to run (default: the environment's)")
    parser.add_argument("--keep", type=Path, default=None, help="Keep the run directories under this folder")
    parser.add_argument(
        "--eval-tasks",
        type=int,
        default=None,
        help="Held-out tasks per eval (default: 100; textcraft, webarena, sciworld 48; deepsearch 28)",
    )
    args = parser.parse_args()

    recipe = args.spec or RECIPES.get(args.env)
    if recipe is None:
        parser.error(f"--env {args.env!r} has no CPU recipe; recipes: {', '.join(RECIPES)} (or pass --spec)")
    if not recipe.is_file():
        parser.error(f"--spec {recipe} does not exist")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds must name distinct seeds, got {args.seeds!r}")
    eval_tasks = args.eval_tasks if args.eval_tasks is not None else EVAL_TASKS.get(args.env, 100)
    if eval_tasks < 1:
        parser.error(f"--eval-tasks must be at least 1, got {eval_tasks}")

    work = args.keep or Path(tempfile.mkdtemp(prefix="agentgym-learning-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shown = recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe
    print(f"# learning benchmark: {args.env}, recipe {shown}")
    print(f"machine: {load_note()}; seeds {seeds}, one after another; {eval_tasks} held-out tasks", flush=True)
    results: list[SeedResult] = []
    try:
        for seed in seeds:
            result = run_seed(recipe, seed, work, eval_tasks)
            results.append(result)
            print(seed_line(result), *environment_lines(result), sep="\n", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    gains = [r.gain[0] for r in results]
    mean = statistics.fmean(gains)
    se = statistics.stdev(gains) / math.sqrt(len(gains)) if len(gains) > 1 else 0.0
    walls = [r.wall_s / 60 for r in results]
    print(
        f"gain over seeds: {mean:+.1f} ± {se:.1f} pts (s.e. over {len(gains)} seeds); wall time per seed: median "
        f"{statistics.median(walls):.1f} min (max {max(walls):.1f}); {load_note()} at the end"
    )
    print(verdict(args.env, results))
    if args.keep is not None:
        print(f"run directories: {work}")


if __name__ == "__main__":
    main()
