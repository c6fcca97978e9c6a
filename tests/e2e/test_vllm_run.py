"""`agentgym run` with `inference.engine: vllm` on vLLM's CPU backend: the whole platform as processes (NATS,
BabyAI, vLLM from .venv-vllm, rollout, trainer), weights rolled into vLLM every step; its vLLM server killed
mid-run is restarted by the runner and serves the current policy version again before the run goes on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from agentgym.local.runner import vllm_python
from agentgym.local.supervisor import scratch_tmpdir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
AGENTGYM = [sys.executable, "-m", "agentgym.cli"]


def spec(total_steps: int) -> dict[str, Any]:
    return {
        "apiVersion": "agentgym.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "vllm-run"},
        "spec": {
            "model": {"name": "builtin:tiny", "dtype": "float32", "maxContextTokens": 1024},
            "environments": [{"name": "babyai", "maxEpisodes": 32, "config": {"list_actions": False}}],
            "algorithm": {"name": "grpo", "groupSize": 2, "learningRate": 1e-4, "klCoef": 0.0, "miniBatchSize": 4},
            "curriculum": {"kind": "scaling_inter", "horizons": [2, 3], "stageSteps": 1},
            "rollout": {"tasksPerStep": 2, "maxTokensPerTurn": 8, "concurrency": 8},
            "inference": {"engine": "vllm", "gpusPerReplica": 0, "maxBatchSize": 8},
            "trainer": {"totalSteps": total_steps, "checkpointEvery": 1},
        },
    }


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def served_version(pid: int) -> int | None:
    """What the vLLM server of `pid` reports on /weight_info (its port read from its command line)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    port = argv[argv.index("--port") + 1]
    try:
        value = httpx.get(f"http://127.0.0.1:{port}/weight_info", timeout=5).json()["weight_version"]
    except (httpx.HTTPError, KeyError, ValueError):
        return None
    return int(value) if str(value).isdigit() else 0


def test_a_vllm_run_trains_rolls_weights_and_survives_a_killed_server(tmp_path: Path) -> None:
    if not vllm_python().exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI: no vLLM environment at {vllm_python()} (scripts/test.sh runs scripts/setup-vllm.sh)")
        pytest.skip(f"no vLLM environment at {vllm_python()}: run scripts/setup-vllm.sh (make vllm)")
    spec_path = tmp_path / "vllm-run.yaml"
    spec_path.write_text(yaml.safe_dump(spec(3)))
    run_dir = tmp_path / "run"
    # The runner's own temporary directory (short: vLLM binds Unix sockets under its children's scratch folders).
    runner_tmp, scratch_environment = scratch_tmpdir("vllm-run", os.environ)
    runner = subprocess.Popen(
        [*AGENTGYM, "run", str(spec_path), "--run-dir", str(run_dir), "--no-live", "--no-evaluate"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **scratch_environment},
    )
    try:
        deadline = time.monotonic() + 900
        # Between two steps (the first checkpoint is written: no episode plays until its policy is served),
        # freeze the rollout worker so none starts, and kill vLLM's whole process tree: a crash.
        while not (run_dir / "checkpoints" / "step-1").exists():
            assert runner.poll() is None, runner.communicate()
            assert time.monotonic() < deadline, "no first checkpoint in time"
            time.sleep(0.05)
        started = {e["process"]: e["pid"] for e in events(run_dir) if e["event"] == "started"}
        os.kill(started["rollout-0"], signal.SIGSTOP)
        try:
            os.killpg(started["inference"], signal.SIGKILL)
            # The runner restarts it (on the base model) and rolls the current policy version into it.
            while True:
                assert runner.poll() is None, runner.communicate()
                assert time.monotonic() < deadline, "vLLM was not restarted onto the current version in time"
                restarted = [e for e in events(run_dir) if e["event"] == "restarted" and e["process"] == "inference"]
                current = json.loads((run_dir / "status.json").read_text())["policyVersion"]
                if restarted and current >= 1 and served_version(restarted[0]["pid"]) == current:
                    break
                time.sleep(0.5)
        finally:
            os.kill(started["rollout-0"], signal.SIGCONT)
        out, err = runner.communicate(timeout=900)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode == 0, out[-3000:] + err[-3000:]
    final = json.loads((run_dir / "status.json").read_text())
    assert final["phase"] == "Succeeded" and final["step"] == 3
    assert final["servedPolicyVersion"] == final["policyVersion"] >= 3  # every step's policy was rolled in
    assert final["metrics"]["restarts.inference"] == 1.0
    # Nothing of the killed vLLM (ZMQ sockets, vllm_dist_* files) nor of the others is left in /tmp: each start's
    # scratch folder went with it.
    assert list(runner_tmp.iterdir()) == []
    shutil.rmtree(runner_tmp)
