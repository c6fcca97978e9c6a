"""Every CPU recipe in examples/ runs: a smoke of `agentgym run` on each, shrunk to a couple of steps.

The learning itself is measured by `benchmarks/learning_bench.py` (minutes per seed); here each recipe's own
environments, splits, warm-up, curriculum and evaluations run for real, so none of them rots. The quickstart is
run end to end by tests/local/test_local_run.py and is not repeated here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentgym.spec import parse_training_run

ROOT = Path(__file__).resolve().parents[2]
AGENTGYM = [sys.executable, "-m", "agentgym.cli"]
RECIPES = sorted((ROOT / "examples").glob("*-cpu.yaml"))


def shrunk(recipe: Path) -> dict[str, Any]:
    """The recipe with its budget cut to two RL steps after two SFT steps, and small batches."""
    document: dict[str, Any] = yaml.safe_load(recipe.read_text())
    spec = document["spec"]
    spec["trainer"].update({"totalSteps": 2, "checkpointEvery": 1})
    if spec["trainer"].get("sftWarmupSteps"):
        spec["trainer"].update({"sftWarmupSteps": 2, "sftTasks": 16})
    spec["rollout"].update({"tasksPerStep": len(spec["environments"]), "concurrency": 8})
    spec["algorithm"].update({"groupSize": 4, "miniBatchSize": 4})
    if spec["curriculum"].get("stageSteps"):
        spec["curriculum"]["stageSteps"] = 1
    return document


def test_there_are_cpu_recipes_and_each_is_a_valid_training_run() -> None:
    assert [p.name for p in RECIPES] == [
        "babyai-textcraft-cpu.yaml",
        "deepsearch-cpu.yaml",
        "sciworld-cpu.yaml",
        "textcraft-cpu.yaml",
        "webarena-cpu.yaml",
    ]
    for recipe in RECIPES:
        run = parse_training_run(yaml.safe_load(recipe.read_text()))
        assert run.spec.model.name.startswith("builtin:"), "a CPU recipe uses a model that ships with the platform"
        assert all(env.eval_split for env in run.spec.environments), "a CPU recipe measures held-out success"
        parse_training_run(shrunk(recipe))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_the_recipe_runs_its_warm_up_steps_and_evaluations(recipe: Path, tmp_path: Path) -> None:
    document = shrunk(recipe)
    spec_path = tmp_path / recipe.name
    spec_path.write_text(yaml.safe_dump(document))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [*AGENTGYM, "run", str(spec_path), "--run-dir", str(run_dir), "--no-live", "--eval-tasks", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # 164 s for the longest (babyai-textcraft) on a quiet 2-core machine; >600 s at load ~4
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["step"] == 2
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    assert set(summary["phases"]) == {"start", "sft", "end"}
    for env in document["spec"]["environments"]:
        end = summary["phases"]["end"]["environments"][env["name"]]
        assert end["split"] == env["evalSplit"] and end["tasks"] == 4 and end["errors"] == 0
        assert len(end["task_success"]) == 4  # what the learning benchmark's paired gain compares
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl_rows = [r for r in rows if "policy_loss" in r]
    spec = parse_training_run(document).spec
    tasks = spec.rollout.tasks_per_step
    assert [r["horizon"] for r in rl_rows] == spec.horizon_stages(spec.environments[0].name)[:2]
    assert all(r["env"]["all"]["trajectories"] == 4 * tasks for r in rl_rows)
    for env in spec.environments:  # each plays its own horizon of the stage
        played = [(r["env"][env.name]["horizon_max"], r["step"]) for r in rl_rows if env.name in r["env"]]
        assert all(horizon == spec.horizon_stages(env.name)[step] for horizon, step in played), played
        assert played or tasks > 1  # a step's tasks are drawn by weight: one environment may miss a step
