"""The operator's pods, run: a TrainingRun trains to Succeeded through the real kopf operator.

The operator reconciles the quickstart's spec (shortened) against the Kubernetes emulator and a real
nats-server; `pod_executor.PodExecutor` plays the kubelet and the Deployment/Job controllers, running every
container's exact command with the pod's env, volumes and network (see there for what it plays and what not).
So the environment service, the HF inference engine, the rollout worker and the trainer run as the cluster
would run them, the weight roll and the curriculum status go through the operator, and a killed pod comes back
as the kubelet would bring it back. Held-out success is measured before (the base model) and after (the last
checkpoint the trainer wrote on the run's claim) with `agentgym eval`, as `agentgym run` measures it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from operator_harness import Cluster, OperatorHandle, load_example
from pod_executor import PodExecutor

RUN = "pods"
EVAL_TASKS = 25


def spec() -> dict[str, Any]:
    document = load_example("quickstart.yaml")
    document["metadata"]["name"] = RUN
    spec = document["spec"]
    spec["trainer"].update(totalSteps=3, checkpointEvery=1, sftWarmupSteps=32, sftTasks=256)
    spec["curriculum"]["stageSteps"] = 1
    spec["rollout"]["tasksPerStep"] = 2
    spec["storage"]["checkpointUri"] = f"file://runs/{RUN}"
    return document


def held_out_success(model: str, tmp_path: Path) -> float:
    done = subprocess.run(
        [sys.executable, "-m", "agentgym.cli", "eval", model, "--env", "babyai", "--split", "test-easy",
         "--tasks", str(EVAL_TASKS), "--samples", "1", "--max-turns", "5", "--max-tokens-per-turn", "36",
         "--set", "list_actions=false", "--out", str(tmp_path / f"eval-{abs(hash(model))}.json")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return float(json.loads(done.stdout)["by_max_turns"]["5"]["success"])


@pytest.mark.slow
async def test_a_training_run_trains_through_the_operator_pods_and_survives_a_killed_pod(
    cluster: Cluster, operator: OperatorHandle, tmp_path: Path
) -> None:
    started = time.monotonic()
    root = tmp_path / "node"
    async with PodExecutor(cluster, root) as executor:
        await cluster.create("TrainingRun", spec())

        async def running() -> Any:
            status = await cluster.status_of(RUN)
            return status if status.get("phase") == "Running" else None

        await cluster.wait_for(running, timeout=300, what="the run Running with every pod ready")

        async def first_step() -> Any:
            status = await cluster.status_of(RUN)
            return status if int(status.get("policyVersion") or 0) >= 1 else None

        await cluster.wait_for(first_step, timeout=600, what="the SFT warm-up's policy (v1)")
        rollout = executor.pod(f"{RUN}-rollout")
        assert rollout is not None
        os.killpg(rollout.process.pid, signal.SIGKILL)  # a crashed worker, mid-run: the kubelet starts it again

        async def finished() -> Any:
            status = await cluster.status_of(RUN)
            return status if status.get("phase") in ("Succeeded", "Failed") else None

        status = await cluster.wait_for(finished, timeout=900, what="the run to finish")
        logs = {p.name: p.read_text()[-1500:] for p in (root / "logs").glob("*.log")}
        assert status["phase"] == "Succeeded", json.dumps(logs, indent=1)
        # The trainer's steps and the policy versions went through the operator into the status.
        assert status["step"] == 3 and status["horizon"] == 5
        assert status["policyVersion"] == 4  # the warm-up, then three steps
        assert status["servedPolicyVersion"] >= 3  # rolled onto the inference pod by the operator
        events = await cluster.events_for(RUN)
        assert any(e.get("reason") == "WeightsLoaded" for e in events)
        # The killed rollout pod was restarted in place, and the run still reached the end.
        assert executor.restarted(f"{RUN}-rollout") >= 1

    # The last checkpoint lies on the run's own claim, where inference loaded each policy from.
    claim = root / "claims" / f"{RUN}-checkpoints"
    saved = sorted(path.parent for path in claim.rglob("step-*/model.safetensors"))
    assert [path.name for path in saved][-1:] == ["step-3"], saved
    last = saved[-1]
    before, after = held_out_success("builtin:tiny", tmp_path), held_out_success(str(last), tmp_path)
    print(f"held-out success {before:.2f} -> {after:.2f}; wall {time.monotonic() - started:.0f} s")
    assert after > before + 0.2
