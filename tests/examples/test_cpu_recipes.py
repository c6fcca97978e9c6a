"""Every CPU recipe in examples/ runs: a smoke of `agentgym run` on each, shrunk to a couple of steps.

The learning itself is measured by `benchmarks/learning_bench.py` (minutes per seed); here each recipe's own
environments, splits, warm-up, curriculum and evaluations run for real, so none of them rots. The quickstart is
run end to end by tests/local/test_local_run.py and is not repeated here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentgym.spec import parse_training_run

ROOT = Path(__file__).resolve().parents[2]
AGENTGYM = [sys.executable, "-m", "agentgym.cli"]
RECIPES = sorted((ROOT / "examples").glob("*-cpu.yaml"))
GROUP = 2
"""Episodes per task in a shrunk run's steps: the smallest group GRPO's advantages are defined on."""


def shrunk(recipe: Path) -> dict[str, Any]:
    """The recipe with its budget cut to two RL steps after two SFT steps (of 8 demonstrations), and groups of two."""
    document: dict[str, Any] = yaml.safe_load(recipe.read_text())
    spec = document["spec"]
    spec["trainer"].update({"totalSteps": 2, "checkpointEvery": 1})
    if spec["trainer"].get("sftWarmupSteps"):
        spec["trainer"].update({"sftWarmupSteps": 2, "sftTasks": 8})
    spec["rollout"].update({"tasksPerStep": len(spec["environments"]), "concurrency": 8})
    spec["algorithm"].update({"groupSize": GROUP, "miniBatchSize": GROUP})
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


@dataclass(frozen=True)
class RecipeRun:
    """What a shrunk recipe's `agentgym run` left: its exit, output tail, status, eval summary and metrics rows."""

    document: dict[str, Any]
    returncode: int
    output_tail: str
    status: dict[str, Any]
    summary: dict[str, Any]
    rows: list[dict[str, Any]]


EVAL_HORIZON = 2
"""Max turns of the shrunk runs' evaluation episodes (`--eval-max-turns`)."""

RECIPES_AT_ONCE = 2
"""Recipe runs in flight together. A run is mostly its one-thread inference engine decoding small batches while
its trainer waits, and such a decode step is bound by one core's matmul kernels, not by the memory they read (5 of
~19 GB/s here), so two runs share 2 cores: the five took 392 s two at a time on the 2-core EPYC (2026-12-07),
each 1-2.5 min alone."""


def run_recipe(recipe: Path, directory: Path) -> RecipeRun:
    """`agentgym run` on the shrunk `recipe` in `directory`; the run's files are read, then removed (its
    SmolLM2 checkpoints are 3.7 GB) unless it failed."""
    document = shrunk(recipe)
    spec_path = directory / recipe.name
    spec_path.write_text(yaml.safe_dump(document))
    run_dir = directory / "run"
    command = [*AGENTGYM, "run", str(spec_path), "--run-dir", str(run_dir), "--no-live", "--eval-tasks", "4"]
    # Evaluations at the recipe's own final horizon (5-10 turns) were three quarters of a run's wall time: played
    # at EVAL_HORIZON turns they still cover each eval split through the run's services in all three phases.
    command += ["--eval-max-turns", str(EVAL_HORIZON)]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired as expired:  # reported by its own test, not as the fixture's error for all
        output = "".join(
            (part if isinstance(part, str) else part.decode(errors="replace"))[-3000:]
            for part in (expired.stdout or b"", expired.stderr or b"")
        )
        result = subprocess.CompletedProcess(command, -1, f"timed out after {expired.timeout} s\n", output)

    def read_json(path: Path) -> dict[str, Any]:
        return json.loads(path.read_text()) if path.exists() else {}

    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    run = RecipeRun(
        document=document,
        returncode=result.returncode,
        output_tail=result.stdout[-3000:] + result.stderr[-3000:],
        status=read_json(run_dir / "status.json"),
        summary=read_json(run_dir / "eval" / "summary.json"),
        rows=[json.loads(line) for line in lines if line.strip()],
    )
    if result.returncode == 0:
        shutil.rmtree(directory)
    return run


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RecipeRun]:
    """Every CPU recipe's shrunk run, `RECIPES_AT_ONCE` at a time, by recipe stem."""
    with ThreadPoolExecutor(RECIPES_AT_ONCE) as pool:
        futures = {p.stem: pool.submit(run_recipe, p, tmp_path_factory.mktemp(p.stem)) for p in RECIPES}
        return {stem: future.result() for stem, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_the_recipe_runs_its_warm_up_steps_and_evaluations(recipe: Path, recipe_runs: dict[str, RecipeRun]) -> None:
    run = recipe_runs[recipe.stem]
    document = run.document
    assert run.returncode == 0, run.output_tail
    status = run.status
    assert status["phase"] == "Succeeded" and status["step"] == 2
    summary = run.summary
    assert set(summary["phases"]) == {"start", "sft", "end"}
    for env in document["spec"]["environments"]:
        end = summary["phases"]["end"]["environments"][env["name"]]
        assert end["split"] == env["evalSplit"] and end["tasks"] == 4 and end["horizon"] == EVAL_HORIZON
        assert end["errors"] == 0, end["error_reasons"]
        assert len(end["task_success"]) == 4  # what the learning benchmark's paired gain compares
    rl_rows = [r for r in run.rows if "policy_loss" in r]
    spec = parse_training_run(document).spec
    tasks = spec.rollout.tasks_per_step
    assert [r["horizon"] for r in rl_rows] == spec.horizon_stages(spec.environments[0].name)[:2]
    assert all(r["env"]["all"]["trajectories"] == GROUP * tasks for r in rl_rows)
    for env in spec.environments:  # each plays its own horizon of the stage
        played = [(r["env"][env.name]["horizon_max"], r["step"]) for r in rl_rows if env.name in r["env"]]
        assert all(horizon == spec.horizon_stages(env.name)[step] for horizon, step in played), played
        assert played or tasks > 1  # a step's tasks are drawn by weight: one environment may miss a step
