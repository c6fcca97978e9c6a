"""One plan: the operator's pods and the local runner's processes run the same commands, modulo endpoints.

Both render `agentgym.plan.plan_run`; these tests hold that for every spec in examples/, and that what the
rollout worker and the trainer are told comes from the spec they read (the bug this plan replaced: the
operator's rollout pods were started without `--tokenizer`, so every paper recipe tokenized Qwen2.5's
prompts with the tiny test tokenizer and polled the HF engine's routes on vLLM).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentgym.inference.models import cache_dir
from agentgym.local.runner import PYTHON, LocalRunner, local_process_specs, vllm_python
from agentgym.operator.config import OperatorConfig
from agentgym.operator.manifests import RunInputs, build_children
from agentgym.plan import Placement, plan_run, setting_text
from agentgym.rollout.serve import rollout_settings
from agentgym.spec import TrainingRun, load_training_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [p for p in sorted((ROOT / "examples").glob("*.yaml")) if "\nkind: TrainingRun" in p.read_text()]

# Flags whose values say where a component runs, not what it runs.
PLACEMENT_FLAGS = {
    "--host",
    "--port",
    "--grpc-port",
    "--nats-url",
    "--inference-url",
    "--spec",
    "--run",
    "--log-level",
    "--master_port",
}


def normalized(argv: list[str]) -> list[str]:
    """`argv` with placement values blanked, env URLs reduced to their names, the local interpreters (this one,
    vLLM's environment's) named as in the images, a builtin model and its local folder (vLLM loads the folder)
    alike, and the local trainer's `--output-dir` (the run folder) left out."""
    if argv[:3] == [PYTHON, "-m", "agentgym.cli"]:
        argv = ["agentgym", *argv[3:]]
    elif argv[0] in (PYTHON, str(vllm_python())):
        argv = ["python", *argv[1:]]
    out: list[str] = []
    skip = False
    for index, token in enumerate(argv):
        if skip:
            skip = False
            continue
        previous = argv[index - 1] if index else ""
        if token == "--output-dir":
            skip = True
        elif previous in PLACEMENT_FLAGS:
            out.append("<placement>")
        elif previous == "--env-url":
            out.append(token.partition("=")[0] + "=<url>")
        elif previous == "--model" and (token.startswith("builtin:") or token.startswith(f"{cache_dir()}/models/")):
            out.append("<builtin model>")
        else:
            out.append(token)
    return out


def operator_commands(run: TrainingRun) -> dict[str, list[str]]:
    children = build_children(RunInputs(run=run, namespace="ml", config=OperatorConfig(), nats_url="nats://n:4222"))
    commands = {}
    for child in children:
        if child["kind"] not in ("Deployment", "Job"):
            continue
        component = child["metadata"]["labels"]["app.kubernetes.io/component"]
        environment = child["metadata"]["labels"].get("agentgym.io/environment")
        name = f"env-{environment}" if component == "env" else component
        commands[name] = child["spec"]["template"]["spec"]["containers"][0]["command"]
    return commands


def local_commands(run: TrainingRun, tmp_path: Path) -> dict[str, list[str]]:
    runner = LocalRunner(run, tmp_path / run.metadata.name)
    ports = {f"env-{e.name}": 10000 + i for i, e in enumerate(run.spec.environments) if e.url is None}
    placement = runner.placement("nats://127.0.0.1:4222", {**ports, "inference": 9999})
    specs = local_process_specs(run, placement, tmp_path / "telemetry")
    return {("rollout" if s.name.startswith("rollout-") else s.name): s.argv for s in specs}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_operator_and_local_runner_run_the_same_commands(example: Path, tmp_path: Path) -> None:
    run = load_training_run(example)
    on_cluster, here = operator_commands(run), local_commands(run, tmp_path)
    owned = {f"env-{e.name}" for e in run.spec.environments if e.url is None}
    assert set(on_cluster) == set(here) == owned | {"inference", "rollout", "trainer"}
    for component in on_cluster:
        assert normalized(on_cluster[component]) == normalized(here[component]), component


def test_local_runner_starts_one_process_per_rollout_worker(tmp_path: Path) -> None:
    run = load_training_run(ROOT / "examples" / "babyai-paper.yaml")
    runner = LocalRunner(run, tmp_path / "run")
    specs = local_process_specs(run, runner.placement("nats://x:1", {"env-babyai": 1, "inference": 2}), tmp_path)
    rollouts = [s for s in specs if s.name.startswith("rollout-")]
    assert len(rollouts) == run.spec.rollout.workers == 4
    assert len({tuple(s.argv) for s in rollouts}) == 1


def test_paper_recipe_rollout_worker_reads_qwen_tokenizer_and_vllm_from_the_spec() -> None:
    run = load_training_run(ROOT / "examples" / "babyai-paper.yaml")
    command = operator_commands(run)["rollout"]
    spec_path = command[command.index("--spec") + 1]
    assert spec_path == "/etc/agentgym/spec.yaml"
    for flag in ("--tokenizer", "--engine", "--concurrency", "--max-context-tokens", "--run"):
        assert flag not in command  # nothing the spec says is repeated as a flag that could be forgotten
    settings = rollout_settings(ROOT / "examples" / "babyai-paper.yaml", None, None, None, None, None)
    assert settings.tokenizer == "Qwen/Qwen2.5-3B-Instruct" and settings.engine == "vllm"
    assert (settings.run, settings.concurrency, settings.max_context_tokens) == ("babyai-scalinginter", 64, 16384)
    # A flag beside the spec overrides its field; without a spec the standalone defaults hold.
    assert rollout_settings(ROOT / "examples" / "babyai-paper.yaml", None, "builtin:tiny", "hf", 3, None).engine == "hf"
    assert rollout_settings(None, "r", None, None, None, None).tokenizer == "builtin:tiny"


def test_rollout_worker_process_loads_the_tokenizer_its_spec_names(tmp_path: Path) -> None:
    """The real CLI, given the paper recipe's spec: it reaches for Qwen2.5's tokenizer (no hub here, so it
    says it cannot load that one) instead of the tiny test tokenizer."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [sys.executable, "-m", "agentgym.cli", "rollout", "worker", "--spec", str(ROOT / "examples/babyai-paper.yaml"),
         "--nats-url", "nats://127.0.0.1:1", "--inference-url", "http://127.0.0.1:1", "--env-url", "babyai=http://x"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "Qwen/Qwen2.5-3B-Instruct" in done.stdout + done.stderr


def test_rollout_worker_refuses_a_bad_spec_or_no_run(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: agentgym.io/v1alpha1\nkind: TrainingRun\nmetadata: {name: x}\nspec: {model: {}}\n")
    base = [sys.executable, "-m", "agentgym.cli", "rollout", "worker", "--nats-url", "n", "--inference-url", "i"]
    for extra, expected in (([f"--spec={bad}"], "spec.model.name"), ([], "--spec")):
        done = subprocess.run(
            [*base, "--env-url", "babyai=http://x", *extra], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 2 and expected in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("value", "text"),
    [("1g", "1g"), ("true", '"true"'), ("12", '"12"'), (True, "true"), (2, "2"), ({"a": [1]}, '{"a": [1]}')],
)
def test_environment_settings_read_back_as_given(value: Any, text: str) -> None:
    """`--set KEY=VALUE` parses VALUE as JSON where it parses: what the plan writes reads back as the spec's value."""
    import json

    assert setting_text(value) == text
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = text
    assert parsed == value


def test_placement_is_all_that_differs(tmp_path: Path) -> None:
    run = load_training_run(ROOT / "examples" / "quickstart.yaml")
    a = Placement(spec_path="/a", nats_url="n1", inference_url="i1", env_urls={"babyai": "u1"})
    b = Placement(spec_path="/b", nats_url="n2", inference_url="i2", env_urls={"babyai": "u2"}, log_level="debug")
    for one, other in zip(plan_run(run, a), plan_run(run, b), strict=True):
        assert normalized(list(one.command)) == normalized(list(other.command))
        assert (one.name, one.kind, one.reads_spec) == (other.name, other.kind, other.reads_spec)


def test_data_parallel_inference_is_one_server_with_engines_behind_it() -> None:
    run = load_training_run(ROOT / "examples" / "quickstart.yaml")
    placement = Placement(spec_path="/a", nats_url="n", inference_url="i", env_urls={"babyai": "u"})
    [single] = [c for c in plan_run(run, placement) if c.name == "inference"]
    assert "--data-parallel" not in single.command  # the default: one engine
    run.spec.inference.data_parallel = 2
    [served] = [c for c in plan_run(run, placement) if c.name == "inference"]
    assert list(served.command[-2:]) == ["--data-parallel", "2"]
