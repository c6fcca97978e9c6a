"""Chaos: one `agentgym run` in which every part is SIGKILLed once, at a different point, and the run still
succeeds with every step trained exactly once on its full set of episodes; on-policy and one step off-policy.

Killed, in this order: the trainer during the SFT warm-up, nats-server after step 1, inference after step 2,
the environment service after step 3, the rollout worker after step 4, the trainer after step 5. The local
runner restarts each (nats-server on the same port and store), rolls the current weights onto a restarted
inference, and the trainer re-requests the episodes an infrastructure fault ended instead of training on them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_local_run import AGENTGYM, metrics_by_step, spec, write_spec

STEPS = 7
KILLS = [(1, "nats"), (2, "inference"), (3, "env-babyai"), (4, "rollout-0"), (5, "trainer")]


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def current_pid(run_dir: Path, process: str) -> int | None:
    pids = [e["pid"] for e in events(run_dir) if e["process"] == process and e["event"] in ("started", "restarted")]
    return int(pids[-1]) if pids else None


def status(run_dir: Path) -> dict[str, Any]:
    try:
        result: dict[str, Any] = json.loads((run_dir / "status.json").read_text())
        return result
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1], ids=["on-policy", "one-step-off-policy"])
def test_every_part_killed_once_and_the_run_trains_every_step_exactly_once(tmp_path: Path, max_staleness: int) -> None:
    """On-policy, and one step off-policy as the quickstart plays (a step's episodes requested before the previous
    update: a part killed then ends episodes of two steps at once)."""
    document = spec("chaos", STEPS)
    document["spec"]["rollout"]["maxStaleness"] = max_staleness
    document["spec"]["trainer"].update(sftWarmupSteps=8, sftLearningRate=1e-3, sftTasks=64)
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [*AGENTGYM, "run", str(write_spec(tmp_path, document)), "--run-dir", str(run_dir), "--no-live",
         "--eval-tasks", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    killed: list[str] = []

    def wait_until(what: str, condition: Callable[[], bool], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert runner.poll() is None, f"the runner ended while waiting for {what}: {runner.communicate()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def kill(process: str) -> None:
        pid = current_pid(run_dir, process)
        assert pid is not None, process
        os.kill(pid, signal.SIGKILL)
        killed.append(process)
        # Until the runner has seen it die: the next kill is of another part.
        wait_until(f"{process} to be restarted", lambda: current_pid(run_dir, process) != pid)

    try:
        trainer_log = run_dir / "logs" / "trainer.log"
        wait_until("the SFT warm-up", lambda: trainer_log.exists() and "SFT warm-up data" in trainer_log.read_text())
        kill("trainer")
        for step, process in KILLS:
            wait_until(f"step {step}", lambda step=step: int(status(run_dir).get("step") or 0) >= step)  # type: ignore[misc]
            kill(process)
        out, err = runner.communicate(timeout=900)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
    assert runner.returncode == 0, out[-3000:] + err[-3000:]
    assert killed == ["trainer", *(process for _, process in KILLS)]
    final = status(run_dir)
    assert final["phase"] == "Succeeded" and final["step"] == STEPS
    assert {c["type"]: c["status"] for c in final["conditions"]}["Complete"] == "True"
    # While a part was down the status said so: Ready False, naming it, each change recorded as an event.
    readiness = [e for e in events(run_dir) if e["event"] == "condition" and e["type"] == "Ready"]
    down = [e for e in readiness if e["status"] == "False" and e["reason"] == "ComponentDown"]
    assert any("nats is down" in e["message"] for e in down), readiness
    assert any("rollout-0 is down" in e["message"] for e in down), readiness
    assert any(e["status"] == "False" and e["reason"] in ("Waiting", "Creating") for e in readiness), readiness
    assert readiness[-1]["reason"] != "ComponentDown"
    restarted = {e["process"] for e in events(run_dir) if e["event"] == "restarted"}
    assert {"trainer", "nats", "inference", "env-babyai", "rollout-0"} <= restarted
    # Every step once, each on its 2 tasks x 2 samples; none trained on an episode a fault ended.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    warm_up = [line for line in lines if "sft/sft_step" in line]
    assert sorted(line["sft/sft_step"] for line in warm_up) == list(range(8))  # the warm-up once, though killed
    assert sorted(int(line["step"]) for line in lines if line not in warm_up) == list(range(STEPS))
    steps = metrics_by_step(run_dir)
    assert [steps[s]["count/used"] for s in range(STEPS)] == [4] * STEPS
    assert all(steps[s].get("count/failed", 0) == 0 for s in range(STEPS)), [steps[s] for s in range(STEPS)]
    rerequested = sum(steps[s].get("count/infra_rerequested", 0) for s in range(STEPS))
    staleness = [steps[s]["staleness_mean"] for s in range(STEPS)]
    assert all(0.0 <= value <= max_staleness for value in staleness), staleness
    print(f"episodes re-requested after infrastructure faults: {rerequested}")
    # Inference serves the final policy, and held-out success was measured on it.
    assert final["servedPolicyVersion"] == final["policyVersion"]
    assert final["metrics"]["eval/end/policy_version"] == final["policyVersion"]
    assert final["metrics"]["eval/end/episodes"] == 20
