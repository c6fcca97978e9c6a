"""Quickstart learning benchmark: does `agentgym run examples/quickstart.yaml` learn, and how fast?

Runs the quickstart end to end (`agentgym run SPEC --no-live` in a fresh run directory: embedded NATS, the
BabyAI service, the HF inference server, the rollout worker, the trainer: SFT warm-up, then GRPO under the
ScalingInter horizon schedule), then prints the run's own held-out evaluations (`<run>/eval/summary.json`:
the same episodes of the eval split, played before training, after the SFT warm-up and at the end) with
their standard errors, the wall time of each phase, and the machine's load, against two targets:

  #8  the whole run:   success gain (start -> end) >= 30 points, in <= 10 minutes
  #7  GRPO alone:      success gain (after SFT -> end) >= 20 points, the GRPO phase in <= 5 minutes

The baseline of each gain is measured in the same run (the initial policy, the warm-started one).

Usage: python benchmarks/quickstart_bench.py [--spec examples/quickstart.yaml] [--run-dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]
ROOT = Path(__file__).resolve().parents[1]


def load_note() -> str:
    """1-minute load average against the CPU count (the figures are wall-clock: contention inflates them)."""
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} (5 min {five:.1f}) on {os.cpu_count()} CPUs"


def phase_line(name: str, phase: dict[str, Any] | None) -> str:
    if phase is None:
        return f"  {name:<22} -"
    return (
        f"  {name:<22} {phase['success']:.3f} ± {phase['success_se']:.3f}   "
        f"({phase['episodes']} episodes, policy v{phase['policy_version']}, {phase['seconds']:.0f} s)"
    )


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(summary: dict[str, Any], wall: float, loads: tuple[str, str]) -> None:
    phases, points, seconds = summary["phases"], summary["gain_points"], summary["seconds"]
    reference = phases.get("end") or phases.get("sft") or phases["start"]
    where = ", ".join(f"{name} {env['split']}" for name, env in reference["environments"].items())
    print(f"# quickstart benchmark: held-out success on {where}, horizon {reference['horizon']}")
    print(f"machine: {loads[0]} at the start, {loads[1]} at the end")
    print("success (± standard error over tasks):")
    print(phase_line("before training", phases.get("start")))
    print(phase_line("after SFT warm-up", phases.get("sft")))
    print(phase_line("end (after GRPO)", phases.get("end")))
    print(
        f"gains: total {points.get('total', float('nan')):+.1f} pts, SFT warm-up {points.get('sft', float('nan')):+.1f}"
        f" pts, GRPO {points.get('rl', float('nan')):+.1f} pts"
    )
    services = seconds.get("services_up", 0.0)
    sft_done = seconds.get("sft_done")
    trainer_done = seconds.get("trainer_done", wall)
    rl = trainer_done - sft_done if sft_done is not None else None
    print(
        "wall time (s): services up {:.0f}; trainer start + SFT warm-up {}; GRPO phase {}; evals {:.0f}/{:.0f}/{:.0f} "
        "(start/sft/end); run total {:.0f}".format(
            services,
            f"{sft_done - services:.0f}" if sft_done is not None else "-",
            f"{rl:.0f}" if rl is not None else "-",
            seconds.get("eval_start", 0.0),
            seconds.get("eval_sft", 0.0),
            seconds.get("eval_end", 0.0),
            wall,
        )
    )
    if "total" in points:
        ok = points["total"] >= 30 and wall <= 600
        print(
            f"#8 whole run: {points['total']:+.1f} pts in {wall / 60:.1f} min (target >= +30 pts, <= 10 min): "
            f"{verdict(ok)}"
        )
    if "rl" in points and rl is not None:
        ok = points["rl"] >= 20 and rl <= 300
        print(
            f"#7 GRPO alone: {points['rl']:+.1f} pts in {rl / 60:.1f} min (target >= +20 pts, <= 5 min): {verdict(ok)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "quickstart.yaml")
    parser.add_argument("--run-dir", type=Path, default=None, help="Run directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="Keep the temporary run directory")
    args = parser.parse_args()

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agentgym-quickstart-bench-")) / "run"
    load_before = load_note()
    started = time.perf_counter()
    result = subprocess.run(
        [*AGENTGYM, "run", str(args.spec), "--run-dir", str(run_dir), "--no-live"],
        cwd=ROOT,
        text=True,
        capture_output=True,
    )
    wall = time.perf_counter() - started
    load_after = load_note()
    try:
        if result.returncode != 0:
            print(result.stdout[-4000:], result.stderr[-4000:], sep="\n")
            raise SystemExit(f"agentgym run failed with exit code {result.returncode}; run directory: {run_dir}")
        print(result.stdout.rstrip())
        print()
        summary = json.loads((run_dir / "eval" / "summary.json").read_text())
        report(summary, wall, (load_before, load_after))
        print(f"run directory: {run_dir}" if (args.keep or args.run_dir) else "")
    finally:
        if args.run_dir is None and not args.keep:
            shutil.rmtree(run_dir.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
