"""Each environment image run as the operator's Deployment runs it (its command line, user, read-only root, /tmp
and /dev/shm emptyDirs) answers /healthz and plays one expert episode to success through its published port."""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml
from image_helpers import ROOT, BuiltImage, built_reference, pod_run_args, run_container

from agentgym.envs import make_expert
from agentgym.envs.client import EnvClient, Opened, Stepped
from agentgym.envs.webarena.env import run_solver
from agentgym.envs.webarena.miniwob import SOLVERS, parse_task_id
from agentgym.operator.config import OperatorConfig
from agentgym.operator.manifests import RunInputs, build_children
from agentgym.plan import HTTP_PORT
from agentgym.spec import parse_training_run

pytestmark = [pytest.mark.images, pytest.mark.slow]

KINDS = ["babyai", "textcraft", "deepsearch", "sciworld", "webarena"]
# Seconds until /healthz answers (a cold JVM pool for SciWorld, Chromium for WebArena).
READY_S = {"sciworld": 180.0, "webarena": 120.0}


def env_pod(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec and container the operator creates for the `kind` environment of a quickstart-like run."""
    document = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    document["spec"]["environments"] = [{"name": kind, "maxEpisodes": 4}]
    run = parse_training_run(document)
    inputs = RunInputs(run=run, namespace="ml", config=OperatorConfig(), nats_url="nats://nats:4222")
    [deployment] = [
        child
        for child in build_children(inputs)
        if child["kind"] == "Deployment" and child["metadata"]["name"].endswith(f"env-{kind}")
    ]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return pod, container


def solvable_task(kind: str, client: EnvClient) -> str:
    expert = make_expert(kind)
    for task_id in client.task_ids("test", limit=50):
        if getattr(expert, "solvable", lambda _: True)(task_id):
            return task_id
    raise AssertionError(f"no task of {kind}'s test split has an expert solution")


def play_expert(kind: str, task_id: str, opened: Opened, client: EnvClient) -> list[Stepped]:
    """The expert's actions stepped in the image's environment, until the episode ends."""
    steps: list[Stepped] = []

    def step(action: str) -> tuple[str, float, bool]:
        steps.append(client.step(opened.episode_id, action))
        return steps[-1].observation, steps[-1].reward, steps[-1].done or steps[-1].truncated

    if kind == "webarena":
        # The scripted solver reads the image's own pages (its Chromium), rather than replaying a
        # demonstration made by the host's.
        run_solver(SOLVERS[parse_task_id(task_id).name], str(opened.info["objective"]), step, opened.observation)
        return steps
    for action in make_expert(kind).demonstrate(task_id):
        if step(action)[2]:
            break
    return steps


@pytest.mark.parametrize("kind", KINDS)
def test_env_image_serves_and_plays_an_episode(built_images: dict[str, BuiltImage], kind: str) -> None:
    image = built_reference(built_images, f"env-{kind}")
    pod, spec = env_pod(kind)
    assert spec["image"].startswith(f"agentgym/env-{kind}:")
    options, command = pod_run_args(pod, spec)
    assert "--read-only" in options and command[:4] == ["agentgym", "env", "serve", kind]
    with run_container(image, command, options, publish=[HTTP_PORT]) as container:
        url = container.url(HTTP_PORT)
        health, ready_s = container.wait_http(f"{url}/healthz", READY_S.get(kind, 60.0))
        assert health.json()["environment"] == kind
        print(f"\n{kind}: /healthz after {ready_s:.1f} s")
        with EnvClient(url, timeout=120) as client:
            task_id = solvable_task(kind, client)
            start = time.monotonic()
            opened = client.create(task_id=task_id)
            assert opened.observation
            steps = play_expert(kind, task_id, opened, client)
            client.close(opened.episode_id)
        assert steps, f"the expert has no actions for {task_id}"
        result = steps[-1]
        print(f"{kind}: {task_id} in {len(steps)} steps, {time.monotonic() - start:.1f} s, reward {result.reward}")
        # Solved: the kind's own success flag (Deep Search has none: a full answer scores 1).
        solved = result.info.get("success", result.reward == 1.0)
        assert result.done and solved is True, (task_id, result)
        assert container.running()
        assert container.stop() in (0, 143), container.logs()[-3000:]  # SIGTERM: a clean exit
