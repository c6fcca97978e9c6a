"""`agentgym run` end to end: real NATS, real BabyAI service, the tiny model, the trainer, as processes."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]
MLFLOW = Path(__file__).resolve().parents[2] / ".venv-ui" / "bin" / "mlflow"


def ui_required() -> bool:
    """CI always checks the UI (scripts/test.sh sets it up); elsewhere only where `make setup-ui` ran."""
    return MLFLOW.exists() or bool(os.environ.get("CI"))


def spec(name: str, total_steps: int) -> dict[str, Any]:
    return {
        "apiVersion": "agentgym.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "builtin:tiny", "dtype": "float32", "maxContextTokens": 1024},
            "environments": [{"name": "babyai", "maxEpisodes": 32}],
            "algorithm": {"name": "grpo", "groupSize": 2, "learningRate": 1e-4, "klCoef": 0.0, "miniBatchSize": 4},
            "curriculum": {"kind": "scaling_inter", "horizons": [2, 3], "stageSteps": 1},
            "rollout": {"tasksPerStep": 2, "maxTokensPerTurn": 8, "concurrency": 8},
            "inference": {"engine": "hf", "gpusPerReplica": 0, "maxBatchSize": 8},
            "trainer": {"totalSteps": total_steps, "checkpointEvery": 1},
        },
    }


def write_spec(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / f"{document['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def metrics_by_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): r for r in rows}


def test_bad_spec_is_rejected_before_anything_starts(tmp_path: Path) -> None:
    document = spec("bad", 1)
    document["spec"]["algorithm"]["groupSize"] = 0
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [*AGENTGYM, "run", str(write_spec(tmp_path, document)), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "spec.algorithm.groupSize: Input should be greater than or equal to 1" in result.stderr
    assert not run_dir.exists()  # nothing was started or written


@pytest.mark.slow
def test_a_warm_started_run_trains_checkpoints_and_reports_what_sft_and_rl_each_contributed(tmp_path: Path) -> None:
    # One run pays for the start-up and the evals once: an SFT warm-up, then two RL steps across a horizon change,
    # one step off-policy as the quickstart runs (step 1's episodes are requested before step 0's update).
    document = spec("warm", 2)
    document["spec"]["trainer"].update({"sftWarmupSteps": 2, "sftLearningRate": 1e-3})
    document["spec"]["rollout"]["maxStaleness"] = 1
    document["spec"]["environments"][0]["evalSplit"] = "test-easy"
    run_dir = tmp_path / "run"
    command = [*AGENTGYM, "run", str(write_spec(tmp_path, document)), "--run-dir", str(run_dir), "--no-live"]
    if ui_required():  # the UI live beside the files (tests/local/test_ui.py checks the UI itself)
        command += ["--ui", "--ui-port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2/2" in result.stdout
    status = json.loads((run_dir / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["step"] == 2
    assert status["servedPolicyVersion"] == status["policyVersion"] == 3  # the warm-up, then two steps
    assert {c["type"]: c["status"] for c in status["conditions"]}["Complete"] == "True"
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [0, 1]
    assert [steps[s]["horizon"] for s in (0, 1)] == [2, 3]  # ScalingInter stepped up after stage 0
    assert all(steps[s]["count/used"] == 4 for s in steps)
    # Step 1's requests went out with v1 while step 0 trained it into v2: one version old, and none dropped.
    assert [steps[s]["staleness_mean"] for s in (0, 1)] == [0.0, 1.0]
    assert not any(steps[s].get("count/stale_dropped") for s in steps)
    assert (run_dir / "checkpoints" / "step-2" / "model.safetensors").exists()
    assert (run_dir / "spec.yaml").exists() and (run_dir / "logs" / "trainer.log").exists()

    # Held-out success of the initial, the warmed-up and the final policy: summary, status and run directory.
    assert "held-out success (babyai test-easy, horizon 3, 75 episodes):" in result.stdout
    assert "SFT warm-up 0.00 -> " in result.stdout and "; GRPO " in result.stdout
    assert "eval (before training): success" in result.stdout and "eval (final policy): success" in result.stdout
    metrics = status["metrics"]
    # start: the initial policy (v0); sft: the warm-started one (v1), measured before the RL steps; end: v3.
    assert [metrics[f"eval/{p}/policy_version"] for p in ("start", "sft", "end")] == [0, 1, 3]
    for phase in ("start", "sft", "end"):
        assert 0.0 <= metrics[f"eval/{phase}/success"] <= 1.0 and metrics[f"eval/{phase}/success_se"] >= 0.0
        assert metrics[f"eval/{phase}/horizon"] == 3 and metrics[f"eval/{phase}/episodes"] == 75
        assert json.loads((run_dir / "eval" / f"{phase}.json").read_text())["environments"]["babyai"]["tasks"] == 75
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    assert set(summary["phases"]) == {"start", "sft", "end"}
    points = summary["gain_points"]
    assert points["total"] == pytest.approx(points["sft"] + points["rl"], abs=0.2)
    assert {"services_up", "trainer_started", "trainer_done", "eval_start", "eval_end"} <= set(summary["seconds"])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["phase"] for e in events if e["event"] == "evaluated"] == ["start", "sft", "end"]

    report = subprocess.run([*AGENTGYM, "report", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    for name in ("reward_success.png", "turns_horizon.png", "failed_truncated.png", "report.html", "summary.txt"):
        assert (run_dir / "report" / name).stat().st_size > 0
    assert "horizons [2, 3]" in (run_dir / "report" / "summary.txt").read_text()
    traces = subprocess.run([*AGENTGYM, "traces", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert traces.returncode == 0 and "8 episodes" in traces.stdout
    if ui_required():
        assert_the_ui_got_the_run_live(run_dir)


def assert_the_ui_got_the_run_live(run_dir: Path) -> None:
    """What every process exported to MLflow during the run, read from its store in the run directory."""
    with sqlite3.connect(run_dir / "mlflow" / "mlflow.db") as db:
        spans = db.execute("SELECT trace_id, name FROM spans").fetchall()
        metrics = db.execute("SELECT key, step FROM metrics").fetchall()
    by_trace: dict[str, set[str]] = {}
    for trace_id, name in spans:
        by_trace.setdefault(trace_id, set()).add(name)
    # One trace per RL step: the trainer's step, its episodes (across NATS), their turns and chat/tool spans.
    steps = [names for names in by_trace.values() if "train_step" in names]
    assert len(steps) == 2, by_trace
    for names in steps:
        assert {"process rollout_request", "invoke_agent agentgym-babyai", "turn 1"} <= names, names
        assert any(name.startswith("chat ") for name in names), names
    assert {step for key, step in metrics if key == "policy_loss"} == {0, 1}
    assert ("eval/end/success", 2) in metrics
    reopened = subprocess.run(
        [*AGENTGYM, "ui", str(run_dir), "--port", "0", "--import-only"], capture_output=True, text=True, timeout=180
    )
    assert reopened.returncode == 0 and "imported" not in reopened.stdout and "traces:" in reopened.stdout


# A killed trainer resuming, losing nothing and counting nothing twice: tests/local/test_chaos.py, which kills
# it twice in one run (during the SFT warm-up and after a step) among the other parts.
