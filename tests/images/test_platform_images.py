"""The platform's own images run as the operator (inference, rollout, trainer) and the chart (operator, its Helm
test) run them: the CPU inference image serves the tiny model, the rollout image's worker joins the run's NATS
stream, the trainer CPU image runs one tiny update, and the operator image starts (logged in to an API server) while
`agentgym operator check` (the Helm test) finds it and NATS answering."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import kmock
import nats
import pytest
import yaml
from image_helpers import ROOT, BuiltImage, built_reference, pod_run_args, run_container, run_once

from agentgym.messaging import EmbeddedNats, RunChannels, ensure_run_streams, free_port
from agentgym.operator.config import OperatorConfig
from agentgym.operator.manifests import RunInputs, build_children, resolved_spec_yaml
from agentgym.plan import HTTP_PORT
from agentgym.spec import TrainingRun, parse_training_run
from agentgym.spec.crd import crd_document

pytestmark = [pytest.mark.images, pytest.mark.slow]

NAMESPACE = "ml"


def quickstart() -> TrainingRun:
    return parse_training_run(yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text()))


def run_pod(run: TrainingRun, component: str, nats_url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec and container the operator creates for a component (`inference`, `rollout`, `trainer`)."""
    inputs = RunInputs(run=run, namespace=NAMESPACE, config=OperatorConfig(), nats_url=nats_url)
    for child in build_children(inputs):
        if child["kind"] in ("Deployment", "Job") and child["metadata"]["name"] == f"{run.metadata.name}-{component}":
            pod = child["spec"]["template"]["spec"]
            return pod, pod["containers"][0]
    raise AssertionError(f"no {component} workload")


def spec_folder(run: TrainingRun, tmp_path: Path) -> Path:
    """The run's spec ConfigMap as the pods see it (/etc/agentgym/spec.yaml)."""
    folder = tmp_path / "spec"
    folder.mkdir()
    (folder / "spec.yaml").write_text(resolved_spec_yaml(run))
    folder.chmod(0o755)
    return folder


def writable_folder(path: Path) -> Path:
    """A claim's folder: the pods' user (10001) writes there."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


@pytest.fixture
def nats_server(tmp_path: Path) -> Any:
    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


def test_inference_cpu_serves_the_tiny_model(built_images: dict[str, BuiltImage], tmp_path: Path) -> None:
    image = built_reference(built_images, "inference-cpu")
    pod, spec = run_pod(quickstart(), "inference", "nats://nats:4222")
    options, command = pod_run_args(pod, spec, host_volumes={"checkpoints": writable_folder(tmp_path / "ckpt")})
    assert command[:3] == ["agentgym", "inference", "serve"] and "builtin:tiny" in command
    with run_container(image, command, options, publish=[HTTP_PORT]) as container:
        url = container.url(HTTP_PORT)
        _, ready_s = container.wait_http(f"{url}/health", 180)
        payload = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0, "logprobs": 1, "return_token_ids": True}
        response = httpx.post(f"{url}/v1/completions", json=payload, timeout=120)
        assert response.status_code == 200, response.text
        body = response.json()
        [choice] = body["choices"]
        assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]["token_logprobs"]) == 4
        assert body["policy_version"] == 0 and body["usage"]["completion_tokens"] == 4
        print(f"\ninference-cpu: /health after {ready_s:.1f} s, completion {choice['token_ids']}")
        assert container.stop() in (0, 143), container.logs()[-3000:]


async def test_rollout_worker_joins_the_runs_stream(
    built_images: dict[str, BuiltImage], tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    image = built_reference(built_images, "rollout")
    run = quickstart()
    channels = RunChannels(run.metadata.name)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_run_streams(js, channels)
    pod, spec = run_pod(run, "rollout", nats_server.url)
    options, command = pod_run_args(
        pod, spec, env={"AGENTGYM_NATS_URL": nats_server.url}, host_volumes={"spec": spec_folder(run, tmp_path)}
    )
    assert command[:3] == ["agentgym", "rollout", "worker"] and nats_server.url in command
    try:
        # The host network: NATS listens on the host's loopback.
        with run_container(image, command, options, network_host=True) as container:
            consumers: list[Any] = []
            for _ in range(240):
                consumers = await js.consumers_info(channels.requests_stream)
                if consumers:
                    break
                assert await asyncio.to_thread(container.running), container.logs()[-4000:]
                await asyncio.sleep(0.5)
            assert [c.name for c in consumers] == ["rollout-workers"], container.logs()[-4000:]
            print(f"\nrollout: joined {channels.requests_stream} after {time.monotonic() - container.started:.1f} s")
            assert await asyncio.to_thread(container.stop) == 0, container.logs()[-3000:]
    finally:
        await nc.close()


TINY_STEP = """
import json, random, torch
from trainer_helpers import fill_logprobs, synthetic_trajectory
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.trainer import RLTrainer
torch.set_num_threads(1)
config = RLTrainerConfig(
    model="builtin:tiny", output_dir="/tmp/run", run="image", algorithm="grpo", group_size=2, mini_batch_size=2,
    micro_batch_tokens=160, learning_rate=1e-3, kl_coef=0.0, total_steps=1, tensorboard=False, otel_metrics=False,
    curriculum={"kind": "fixed", "max_turns": 5},
)
trainer = RLTrainer(config)
batch = [synthetic_trajectory(random.Random(s), step=0, group=0, sample=s) for s in range(2)]
fill_logprobs(trainer.policy, batch)
before = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
metrics = trainer.train_step(batch)
changed = any(not torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())
print("RESULT", json.dumps({"step": trainer.step, "version": trainer.policy_version, "changed": changed,
                            "grad_norm": metrics.train["grad_norm"]}))
"""


SMOLLM2_LOAD = """
from agentgym.inference.models import load_tokenizer, resolve_model
folder = resolve_model("builtin:smollm2-135m")
print("RESULT", folder, len(load_tokenizer(folder)))
"""
# A rollout worker only tokenizes (`agentgym.rollout.serve`): its image has no torch.
SMOLLM2_TOKENIZER = """
from agentgym.inference.models import load_tokenizer_by_name
print("RESULT", len(load_tokenizer_by_name("builtin:smollm2-135m")))
"""


@pytest.mark.parametrize("component", ["inference", "rollout", "trainer"])
def test_a_smollm2_runs_pods_convert_the_model_into_their_writable_tmp(
    built_images: dict[str, BuiltImage], tmp_path: Path, component: str
) -> None:
    """examples/deepsearch-cpu.yaml's model is converted from its wheel on first use: in each pod that loads it,
    under the pod's read-only root, user and env, as the operator creates it."""
    run = parse_training_run(yaml.safe_load((ROOT / "examples" / "deepsearch-cpu.yaml").read_text()))
    image = built_reference(
        built_images, {"inference": "inference-cpu", "trainer": "trainer-cpu"}.get(component, component)
    )
    pod, spec = run_pod(run, component, "nats://nats:4222")
    options, _ = pod_run_args(
        pod,
        spec,
        env={"AGENTGYM_NATS_URL": "nats://nats:4222"},
        host_volumes={"spec": spec_folder(run, tmp_path), "checkpoints": writable_folder(tmp_path / "ckpt")},
    )
    assert "--read-only" in options
    script = SMOLLM2_TOKENIZER if component == "rollout" else SMOLLM2_LOAD
    code, output = run_once(image, ["python", "-c", script], options, timeout=300)
    assert code == 0, output[-3000:]
    expected = (
        "RESULT 49152" if component == "rollout" else "RESULT /tmp/agentgym-cache/models/smollm2-135m-instruct 49152"
    )
    assert expected in output


def test_trainer_cpu_runs_a_tiny_step(built_images: dict[str, BuiltImage], tmp_path: Path) -> None:
    image = built_reference(built_images, "trainer-cpu")
    run = quickstart()
    pod, spec = run_pod(run, "trainer", "nats://nats:4222")
    options, command = pod_run_args(
        pod,
        spec,
        env={"AGENTGYM_NATS_URL": "nats://nats:4222"},
        host_volumes={"spec": spec_folder(run, tmp_path), "checkpoints": writable_folder(tmp_path / "ckpt")},
    )
    assert command[:3] == ["python", "-m", "agentgym.trainer.entrypoint"]
    # The trainer pod's user, read-only root and volumes; the test's own script instead of the entrypoint.
    helpers = ROOT / "tests" / "trainer" / "trainer_helpers.py"
    options += ["--volume", f"{helpers}:/opt/tests/trainer_helpers.py:ro", "--env", "PYTHONPATH=/opt/tests"]
    code, output = run_once(image, ["python", "-c", TINY_STEP], options, timeout=600)
    assert code == 0, output[-4000:]
    result = json.loads(output.split("RESULT", 1)[1].strip().splitlines()[0])
    assert result["step"] == 1 and result["version"] == 1 and result["changed"] and result["grad_norm"] > 0
    print(f"\ntrainer-cpu: one step, {result}")


def render_chart(nats_url: str) -> list[dict[str, Any]]:
    """The chart's objects (release `agentgym`), its bundled NATS replaced by `nats_url`."""
    values = {"nats": {"enabled": False}, "messaging": {"external": {"url": nats_url}}}
    with helm.Chart.load(ROOT / "charts" / "agentgym") as chart:
        manifests = chart.render(values, name="agentgym", namespace="agentgym-system", is_install=True)
    return [
        doc for path, text in manifests.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc
    ]


def find(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def kube_emulator() -> Any:
    """tests/operator's Kubernetes API emulator (kmock with CRD schemas, the operator tests' API server)."""
    if "kube_emulator" not in sys.modules:
        spec = importlib.util.spec_from_file_location("kube_emulator", ROOT / "tests" / "operator" / "kube_emulator.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["kube_emulator"] = module
        spec.loader.exec_module(module)
    return sys.modules["kube_emulator"]


@pytest.fixture
async def api() -> AsyncIterator[Any]:
    async with kube_emulator().FidelityKubernetesEmulator() as emulator, kmock.Server(emulator):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            emulator.resources.load_bundled()
        emulator.register_crd(crd_document())
        yield emulator


async def test_operator_runs_and_its_helm_test_passes(
    built_images: dict[str, BuiltImage], tmp_path: Path, nats_server: EmbeddedNats, api: Any
) -> None:
    image = built_reference(built_images, "operator")
    rendered = render_chart(nats_server.url)
    deployment = find(rendered, "Deployment", "agentgym-operator")
    config_map = find(rendered, "ConfigMap", "agentgym-operator")
    helm_test = find(rendered, "Pod", "agentgym-test-platform")
    config_dir = tmp_path / "operator-config"
    config_dir.mkdir()
    for key, text in config_map["data"].items():
        (config_dir / key).write_text(text)
    kube_dir = tmp_path / "kube"
    kube_dir.mkdir()
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": NAMESPACE}}],
        "clusters": [{"name": "test", "cluster": {"server": str(api.url).rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": "test-token"}}],
    }
    (kube_dir / "config").write_text(yaml.safe_dump(kubeconfig))
    pod = deployment["spec"]["template"]["spec"]
    options, command = pod_run_args(
        pod, pod["containers"][0], env={"POD_NAMESPACE": "agentgym-system"}, host_volumes={"config": config_dir}
    )
    assert command[:3] == ["agentgym", "operator", "run"]
    # The host network (the API server and NATS listen on loopback): a free port for kopf's liveness endpoint.
    port = free_port()
    command = [part.replace(":8080/", f":{port}/") for part in command]
    options += ["--volume", f"{kube_dir}:/etc/kube:ro", "--env", "KUBECONFIG=/etc/kube/config"]
    with run_container(image, command, options, network_host=True) as operator:
        _, ready_s = await asyncio.to_thread(operator.wait_http, f"http://127.0.0.1:{port}/healthz", 120)
        check_pod = helm_test["spec"]
        check_options, check = pod_run_args(check_pod, check_pod["containers"][0])
        assert check[:3] == ["agentgym", "operator", "check"]
        operator_url = check.index("--operator-url") + 1
        check[operator_url] = f"http://127.0.0.1:{port}/healthz"
        code, output = await asyncio.to_thread(run_once, image, check, [*check_options, "--network", "host"])
        assert code == 0 and "operator and NATS answer" in output, output[-3000:]
        print(f"\noperator: liveness after {ready_s:.1f} s; helm test: {output.strip()[-200:]}")
        assert await asyncio.to_thread(operator.running), operator.logs()[-3000:]
        assert await asyncio.to_thread(operator.stop) in (0, 143), operator.logs()[-3000:]
