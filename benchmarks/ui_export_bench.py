"""What the live UI costs a run: `agentgym run --ui` (spans exported to MLflow beside the JSONL, metrics followed)
against the same run without it, interleaved on this machine.

Each round plays the same short spec twice, UI off then on (the order alternates between rounds): a BabyAI run of
the tiny model with `--steps` RL steps, no evals, so the wall time is the run itself. Printed per round and as
medians: the run's wall time, the training time (the first RL step's start to the last one's end, from the
trainer's spans), the spans written, spans per second of training, and the on/off ratios. The machine is shared:
the load is printed with each.

Usage: python benchmarks/ui_export_bench.py [--rounds 3] [--steps 4]   (needs `make setup-ui`)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]


def spec(steps: int) -> dict[str, Any]:
    return {
        "apiVersion": "agentgym.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "ui-bench"},
        "spec": {
            "model": {"name": "builtin:tiny", "dtype": "float32", "maxContextTokens": 1024},
            "environments": [{"name": "babyai", "maxEpisodes": 64}],
            "algorithm": {"name": "grpo", "groupSize": 4, "learningRate": 1e-4, "klCoef": 0.0, "miniBatchSize": 8},
            "curriculum": {"kind": "scaling_inter", "horizons": [3, 5], "stageSteps": max(1, steps // 2)},
            "rollout": {"tasksPerStep": 4, "maxTokensPerTurn": 16, "concurrency": 16},
            "inference": {"engine": "hf", "gpusPerReplica": 0, "maxBatchSize": 16},
            "trainer": {"totalSteps": steps, "checkpointEvery": steps},
        },
    }


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} (5 min {five:.1f}) on {os.cpu_count()} CPUs"


def one_run(workdir: Path, steps: int, ui: bool, index: int) -> dict[str, float]:
    spec_path = workdir / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec(steps)))
    run_dir = workdir / f"run-{index}-{'ui' if ui else 'off'}"
    command = [*AGENTGYM, "run", str(spec_path), "--run-dir", str(run_dir), "--no-live", "--no-evaluate"]
    if ui:
        command += ["--ui", "--ui-port", "0"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"run failed ({'ui' if ui else 'off'}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    spans = [json.loads(line) for line in (run_dir / "telemetry" / "traces.jsonl").read_text().splitlines() if line]
    steps = [span for span in spans if span["name"] == "train_step"]
    # Training time: the first RL step's start to the last one's end, from the trainer's own spans.
    training = (max(s["end_unix_nano"] for s in steps) - min(s["start_unix_nano"] for s in steps)) / 1e9
    return {"wall_s": wall, "train_s": training, "spans": float(len(spans)), "spans_per_s": len(spans) / training}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    print(f"ui export bench: {args.rounds} rounds x (off, on), {args.steps} RL steps each; {load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ui-bench-") as directory:
        for index in range(args.rounds):
            order = (False, True) if index % 2 == 0 else (True, False)
            for ui in order:
                figures = one_run(Path(directory), args.steps, ui, index)
                results[ui].append(figures)
                print(
                    f"round {index + 1} ui={'on ' if ui else 'off'}: wall {figures['wall_s']:6.1f} s, training "
                    f"{figures['train_s']:6.1f} s, {figures['spans']:.0f} spans ({figures['spans_per_s']:.1f}/s); "
                    f"{load()}",
                    flush=True,
                )

    def median(ui: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[ui])

    print("medians:")
    for key, label in (("wall_s", "wall time"), ("train_s", "training time"), ("spans_per_s", "spans per second")):
        off, on = median(False, key), median(True, key)
        print(f"  {label:17s} off {off:8.2f}  on {on:8.2f}  on/off {on / off:5.2f}")


if __name__ == "__main__":
    main()
