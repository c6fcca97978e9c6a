"""The children of a TrainingRun, as pure functions of the validated spec (+ the operator config).

    children = build_children(RunInputs(run=run, namespace="ml", config=config, nats_url=url))

Per run, in its namespace:
- ConfigMap `<run>-spec`: the resolved spec (`spec.yaml`) the trainer and workers read;
- Secret `<run>-nats`: the NATS URL with credentials (`url`), read by the trainer and workers;
- per environment without a `url`: Deployment + Service + HorizontalPodAutoscaler `<run>-env-<kind>`;
- Deployment + Service `<run>-inference` (vLLM on GPUs, or the platform's HF engine for `engine: hf`);
- Deployment `<run>-rollout` (the agent loop workers);
- Job `<run>-trainer` (DeepSpeed launcher for `backend: deepspeed`);
- NetworkPolicies `<run>-envs`, `<run>-inference`, `<run>-workers`.

Nothing here talks to the API server, so building is idempotent by construction; `reconcile` applies the
result. When the run is idle (suspended, or its trainer finished) every Deployment has 0 replicas, the
HPAs are left out (they would scale back up) and the Job is suspended only for `suspend: true`.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import yaml

from agentgym import plan
from agentgym.operator.config import EnvironmentDefaults, OperatorConfig, Resources
from agentgym.plan import GRPC_PORT, HTTP_PORT, Placement
from agentgym.spec import API_GROUP, TrainingRun
from agentgym.telemetry import TELEMETRY_DIR_VAR

JSONDict = dict[str, Any]

MANAGED_BY = "agentgym-operator"
RUN_LABEL = f"{API_GROUP}/run"
ENVIRONMENT_LABEL = f"{API_GROUP}/environment"
COMPONENT_LABEL = "app.kubernetes.io/component"
NATS_CLIENT_LABEL = f"{API_GROUP}/nats-client"
PLATFORM_LABEL = f"{API_GROUP}/platform"
POLICY_VERSION_ANNOTATION = f"{API_GROUP}/policy-version"
CHECKPOINT_ANNOTATION = f"{API_GROUP}/checkpoint"
SPEC_HASH_ANNOTATION = f"{API_GROUP}/spec-hash"
WORKDIR = "/var/lib/agentgym"
SPEC_DIR = "/etc/agentgym"
POD_TELEMETRY_DIR = "/tmp/telemetry"
SPEC_PATH = f"{SPEC_DIR}/spec.yaml"
NATS_URL_ENV = "AGENTGYM_NATS_URL"
GPU = "nvidia.com/gpu"
MAX_NAME = 52  # leaves room for the suffixes controllers add to pod names

POD_SECURITY_CONTEXT: JSONDict = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: JSONDict = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@dataclass(frozen=True)
class Checkpoint:
    """A policy version and where its weights are."""

    version: int
    uri: str


@dataclass(frozen=True)
class RunInputs:
    run: TrainingRun
    namespace: str
    config: OperatorConfig
    nats_url: str
    """With credentials: it only ever goes into the run's Secret."""
    inference_checkpoint: Checkpoint | None = None
    """Inference starts from this checkpoint instead of `spec.model.name` (after a restart onto weights)."""
    finished: bool = False
    """The trainer Job completed or failed: scale the rest to zero."""

    @property
    def name(self) -> str:
        return self.run.metadata.name

    @property
    def idle(self) -> bool:
        return self.run.spec.suspend or self.finished


# ---------------------------------------------------------------------------------------------------------------------
# names and labels
# ---------------------------------------------------------------------------------------------------------------------


def child_name(run: str, suffix: str) -> str:
    """`<run>-<suffix>`: a DNS-1035 label (starts with a letter), at most 52 characters, unique per run."""
    head = run if run[:1].isalpha() else f"r-{run}"
    name = f"{head}-{suffix}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(run.encode()).hexdigest()[:6]
    room = MAX_NAME - len(suffix) - len(digest) - 2
    return f"{head[:room].rstrip('-')}-{digest}-{suffix}"


def env_name(run: str, kind: str) -> str:
    return child_name(run, f"env-{kind}")


def labels(run: str, component: str, **extra: str) -> dict[str, str]:
    base = {
        "app.kubernetes.io/name": "agentgym",
        "app.kubernetes.io/part-of": "agentgym",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        COMPONENT_LABEL: component,
        RUN_LABEL: run,
    }
    return {**base, **extra}


def selector(run: str, component: str, environment: str | None = None) -> dict[str, str]:
    chosen = {RUN_LABEL: run, COMPONENT_LABEL: component}
    if environment is not None:
        chosen[ENVIRONMENT_LABEL] = environment
    return chosen


def _meta(inputs: RunInputs, name: str, component: str, **extra_labels: str) -> JSONDict:
    return {"name": name, "namespace": inputs.namespace, "labels": labels(inputs.name, component, **extra_labels)}


def service_url(inputs: RunInputs, name: str) -> str:
    return f"http://{name}.{inputs.namespace}.svc:{HTTP_PORT}"


def placement(inputs: RunInputs) -> Placement:
    """Where the plan's components run on the cluster: the mounted spec, Service DNS names, the NATS Secret
    through `$(AGENTGYM_NATS_URL)`, each pod on its own address, inference restarted onto a checkpoint."""
    checkpoint = inputs.inference_checkpoint
    return Placement(
        spec_path=SPEC_PATH,
        nats_url=f"$({NATS_URL_ENV})",
        inference_url=service_url(inputs, child_name(inputs.name, "inference")),
        env_urls=environment_urls(inputs),
        inference_model=(checkpoint_path(checkpoint.uri) or checkpoint.uri) if checkpoint is not None else None,
        inference_policy_version=checkpoint.version if checkpoint is not None else 0,
    )


def _command(component: plan.Component) -> list[str]:
    return list(component.command)


def environment_urls(inputs: RunInputs) -> dict[str, str]:
    """Where rollout workers reach each environment: the run's own service, or the spec's `url`."""
    return {
        env.name: env.url or service_url(inputs, env_name(inputs.name, env.name))
        for env in inputs.run.spec.environments
    }


# ---------------------------------------------------------------------------------------------------------------------
# pod building blocks
# ---------------------------------------------------------------------------------------------------------------------


def checkpoint_path(uri: str) -> str | None:
    """The in-pod path of a file checkpoint URI (relative paths live under /var/lib/agentgym), None if remote."""
    parts = urlsplit(uri)
    if parts.scheme not in ("", "file"):
        return None
    path = (parts.netloc + parts.path) if parts.scheme == "file" else uri
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(WORKDIR, path))


def checkpoint_mount(uri: str) -> str | None:
    """Where the checkpoint volume is mounted: the parent of the run's checkpoint directory (runs sharing a
    claim get separate directories), or the directory itself when its parent is `/`."""
    path = checkpoint_path(uri)
    if path is None:
        return None
    parent = posixpath.dirname(path)
    return path if parent in ("/", "") else parent


# The parts that load the policy's weights, and the writable cache a converted builtin model goes to. (Rollout
# workers only tokenize: SmolLM2's tokenizer is baked into their image's cache.)
MODEL_COMPONENTS = frozenset({"inference", "trainer"})
POD_MODEL_CACHE_DIR = "/tmp/agentgym-cache"


def _env(inputs: RunInputs, component: str) -> list[JSONDict]:
    telemetry = inputs.run.spec.telemetry
    endpoint = telemetry.otlp_endpoint or inputs.config.otlp_endpoint
    env = [
        {"name": "AGENTGYM_RUN", "value": inputs.name},
        {"name": "HOME", "value": "/tmp"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "OTEL_SERVICE_NAME", "value": f"agentgym-{component}"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": f"agentgym.run={inputs.name},k8s.namespace.name={inputs.namespace}",
        },
        {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": str(telemetry.sample_ratio)},
    ]
    model = inputs.run.spec.model.name
    if component in MODEL_COMPONENTS and model.startswith("builtin:") and model != "builtin:tiny":
        # The images hold builtin:tiny only (in a read-only cache); builtin:smollm2-135m is converted from its wheel
        # on first use, into the writable emptyDir (~540 MB), so the root filesystem stays read-only.
        env.append({"name": "AGENTGYM_CACHE_DIR", "value": POD_MODEL_CACHE_DIR})
    if endpoint:
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": endpoint})
    else:
        # No collector: JSONL files on the writable emptyDir (the root filesystem is read-only).
        env.append({"name": TELEMETRY_DIR_VAR, "value": POD_TELEMETRY_DIR})
    return env


def _nats_env(inputs: RunInputs) -> JSONDict:
    secret = {"name": child_name(inputs.name, "nats"), "key": "url"}
    return {"name": NATS_URL_ENV, "valueFrom": {"secretKeyRef": secret}}


def _volumes(
    inputs: RunInputs, *, spec: bool = False, checkpoints: bool = False, shm: str | None = None
) -> tuple[list[JSONDict], list[JSONDict]]:
    volumes: list[JSONDict] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[JSONDict] = [{"name": "tmp", "mountPath": "/tmp"}]
    if spec:
        volumes.append({"name": "spec", "configMap": {"name": child_name(inputs.name, "spec")}})
        mounts.append({"name": "spec", "mountPath": SPEC_DIR, "readOnly": True})
    if shm:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    storage = inputs.run.spec.storage
    mount = checkpoint_mount(storage.checkpoint_uri)
    if checkpoints and mount is not None:
        claim = checkpoint_claim_name(inputs)
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "checkpoints", "mountPath": mount})
    return volumes, mounts


def _resources(base: Resources, gpus: int = 0) -> JSONDict:
    resources = base.as_dict()
    if gpus > 0:
        resources.setdefault("limits", {})[GPU] = str(gpus)
        resources.setdefault("requests", {})[GPU] = str(gpus)
    return resources


def _pod_spec(
    inputs: RunInputs,
    containers: list[JSONDict],
    volumes: list[JSONDict],
    *,
    gpus: int = 0,
    restart_policy: str | None = None,
    grace_seconds: int = 30,
) -> JSONDict:
    config = inputs.config
    spec: JSONDict = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": dict(POD_SECURITY_CONTEXT),
        "terminationGracePeriodSeconds": grace_seconds,
        "containers": containers,
        "volumes": volumes,
    }
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    if config.images.pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in config.images.pull_secrets]
    if config.node_selector:
        spec["nodeSelector"] = dict(config.node_selector)
    if gpus > 0 and config.gpu_tolerations:
        spec["tolerations"] = [dict(t) for t in config.gpu_tolerations]
    return spec


def _container(
    name: str,
    image: str,
    command: list[str],
    inputs: RunInputs,
    *,
    env: list[JSONDict],
    mounts: list[JSONDict],
    resources: JSONDict,
    ports: list[JSONDict] | None = None,
    workdir: str | None = None,
) -> JSONDict:
    container: JSONDict = {
        "name": name,
        "image": image,
        "imagePullPolicy": inputs.config.images.pull_policy,
        "command": command,
        "env": env,
        "resources": resources,
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": mounts,
    }
    if ports:
        container["ports"] = ports
    if workdir:
        container["workingDir"] = workdir
    return container


def _http_probe(path: str, *, period: int, failures: int, delay: int = 0) -> JSONDict:
    probe: JSONDict = {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }
    if delay:
        probe["initialDelaySeconds"] = delay
    return probe


def _deployment(
    inputs: RunInputs,
    name: str,
    component: str,
    replicas: int,
    pod: JSONDict,
    *,
    environment: str | None = None,
    pod_annotations: dict[str, str] | None = None,
) -> JSONDict:
    extra = {ENVIRONMENT_LABEL: environment} if environment else {}
    pod_labels = {**labels(inputs.name, component, **extra), PLATFORM_LABEL: "true"}
    if component in ("rollout", "trainer"):
        pod_labels[NATS_CLIENT_LABEL] = "true"
    template_meta: JSONDict = {"labels": pod_labels}
    if pod_annotations:
        template_meta["annotations"] = dict(pod_annotations)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(inputs, name, component, **extra),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector(inputs.name, component, environment)},
            "template": {"metadata": template_meta, "spec": pod},
        },
    }


# ---------------------------------------------------------------------------------------------------------------------
# the children
# ---------------------------------------------------------------------------------------------------------------------


def resolved_spec_yaml(run: TrainingRun) -> str:
    """The spec with every default filled in: what the trainer and workers read."""
    document = run.to_document()
    document.pop("status", None)
    document["metadata"] = {k: v for k, v in document["metadata"].items() if k in ("name", "namespace")}
    return yaml.safe_dump(document, sort_keys=False)


def spec_config_map(inputs: RunInputs) -> JSONDict:
    text = resolved_spec_yaml(inputs.run)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            **_meta(inputs, child_name(inputs.name, "spec"), "spec"),
            "annotations": {SPEC_HASH_ANNOTATION: hashlib.sha256(text.encode()).hexdigest()[:16]},
        },
        "data": {"spec.yaml": text},
    }


def nats_secret(inputs: RunInputs) -> JSONDict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(inputs, child_name(inputs.name, "nats"), "messaging"),
        "type": "Opaque",
        "data": {"url": base64.b64encode(inputs.nats_url.encode()).decode()},
    }


def environment_children(inputs: RunInputs, kind: str) -> list[JSONDict]:
    """Deployment + Service (+ HPA unless idle) of one environment kind."""
    env = next(e for e in inputs.run.spec.environments if e.name == kind)
    defaults: EnvironmentDefaults = inputs.config.environment(kind)
    name = env_name(inputs.name, kind)
    volumes, mounts = _volumes(inputs, shm=defaults.shm_size)
    container = _container(
        "env",
        defaults.image,
        _command(plan.environment_service(env, placement(inputs))),
        inputs,
        env=_env(inputs, f"env-{kind}") + [{"name": k, "value": v} for k, v in sorted(defaults.env.items())],
        mounts=mounts,
        resources=_resources(defaults.resources),
        ports=[
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
        ],
    )
    container["readinessProbe"] = _http_probe("/healthz", period=5, failures=3)
    container["livenessProbe"] = _http_probe("/healthz", period=20, failures=3, delay=30)
    pod = _pod_spec(inputs, [container], volumes)
    replicas = 0 if inputs.idle else max(1, env.replicas.min)
    children = [
        _deployment(inputs, name, "env", replicas, pod, environment=kind, pod_annotations=_scrape_annotations(inputs)),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(inputs, name, "env", **{ENVIRONMENT_LABEL: kind}),
            "spec": {
                "type": "ClusterIP",
                "selector": selector(inputs.name, "env", kind),
                "ports": [
                    {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                    {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                ],
            },
        },
    ]
    if not inputs.idle:
        minimum = max(1, env.replicas.min)
        children.append(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": _meta(inputs, name, "env", **{ENVIRONMENT_LABEL: kind}),
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                    "minReplicas": minimum,
                    "maxReplicas": max(minimum, env.replicas.max),
                    "metrics": [
                        {
                            "type": "Resource",
                            "resource": {
                                "name": "cpu",
                                "target": {
                                    "type": "Utilization",
                                    "averageUtilization": defaults.target_cpu_utilization,
                                },
                            },
                        }
                    ],
                },
            }
        )
    return children


def inference_children(inputs: RunInputs) -> list[JSONDict]:
    spec = inputs.run.spec
    inference = spec.inference
    settings = inputs.config.inference
    name = child_name(inputs.name, "inference")
    checkpoint = inputs.inference_checkpoint
    gpus = inference.gpus_per_replica
    if inference.engine == "vllm":
        server = plan.inference_server(
            inputs.run,
            placement(inputs),
            weight_transfer_backend=settings.vllm.weight_transfer_backend,
            extra_args=settings.vllm.extra_args,
        )
        image = inputs.config.images.vllm
        resources = _resources(settings.vllm.resources, gpus)
        shm: str | None = settings.vllm.shm_size
    else:
        server = plan.inference_server(inputs.run, placement(inputs))
        image = inputs.config.images.inference_cpu
        resources = _resources(settings.hf.gpu_resources if gpus else settings.hf.resources, gpus)
        shm = None
    command, health = _command(server), server.health_path or plan.HEALTH_PATH
    extra_env = [{"name": k, "value": v} for k, v in sorted(server.env.items())] + [
        {"name": "HF_HOME", "value": "/tmp/hf"}
    ]
    volumes, mounts = _volumes(inputs, checkpoints=True, shm=shm)
    container = _container(
        "inference",
        image,
        command,
        inputs,
        env=_env(inputs, "inference") + extra_env,
        mounts=mounts,
        resources=resources,
        ports=[{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        workdir=WORKDIR,
    )
    container["startupProbe"] = _http_probe(health, period=10, failures=180)
    container["readinessProbe"] = _http_probe(health, period=5, failures=3)
    container["livenessProbe"] = _http_probe(health, period=30, failures=5)
    pod = _pod_spec(inputs, [container], volumes, gpus=gpus, grace_seconds=60)
    annotations = (
        {POLICY_VERSION_ANNOTATION: str(checkpoint.version), CHECKPOINT_ANNOTATION: checkpoint.uri}
        if checkpoint is not None
        else None
    )
    replicas = 0 if inputs.idle else inference.replicas
    pod_annotations = {**_scrape_annotations(inputs), **(annotations or {})}
    deployment = _deployment(inputs, name, "inference", replicas, pod, pod_annotations=pod_annotations or None)
    if annotations:
        deployment["metadata"]["annotations"] = dict(annotations)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(inputs, name, "inference"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(inputs.name, "inference"),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [deployment, service]


def rollout_deployment(inputs: RunInputs) -> JSONDict:
    rollout = inputs.run.spec.rollout
    volumes, mounts = _volumes(inputs, spec=True)
    container = _container(
        "rollout",
        inputs.config.images.rollout,
        _command(plan.rollout_worker(inputs.run, placement(inputs))),
        inputs,
        env=[*_env(inputs, "rollout"), _nats_env(inputs)],
        mounts=mounts,
        resources=_resources(inputs.config.rollout.resources),
    )
    pod = _pod_spec(inputs, [container], volumes, grace_seconds=60)
    replicas = 0 if inputs.idle else rollout.workers
    return _deployment(inputs, child_name(inputs.name, "rollout"), "rollout", replicas, pod)


def trainer_job(inputs: RunInputs) -> JSONDict:
    trainer = inputs.run.spec.trainer
    settings = inputs.config.trainer
    gpus = trainer.gpus
    volumes, mounts = _volumes(inputs, spec=True, checkpoints=True, shm=settings.shm_size if gpus else None)
    container = _container(
        "trainer",
        inputs.config.images.trainer,
        _command(plan.trainer(inputs.run, placement(inputs))),
        inputs,
        env=[*_env(inputs, "trainer"), _nats_env(inputs)],
        mounts=mounts,
        resources=_resources(settings.gpu_resources if gpus else settings.resources, gpus),
        workdir=WORKDIR,
    )
    pod = _pod_spec(inputs, [container], volumes, gpus=gpus, restart_policy="Never", grace_seconds=120)
    pod_labels = {**labels(inputs.name, "trainer"), PLATFORM_LABEL: "true", NATS_CLIENT_LABEL: "true"}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(inputs, child_name(inputs.name, "trainer"), "trainer"),
        "spec": {
            "suspend": inputs.run.spec.suspend,
            "backoffLimit": settings.backoff_limit,
            "completions": 1,
            "parallelism": 1,
            "template": {"metadata": {"labels": pod_labels}, "spec": pod},
        },
    }


def _scrape_annotations(inputs: RunInputs) -> dict[str, str]:
    """The `prometheus.io/*` annotations of a pod serving `/metrics` on the HTTP port, when scraping is on."""
    if inputs.config.metrics_scrape is None:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT), "prometheus.io/path": "/metrics"}


def network_policies(inputs: RunInputs) -> list[JSONDict]:
    run = inputs.name
    rollout_peer = {"podSelector": {"matchLabels": selector(run, "rollout")}}
    inference_peers: list[JSONDict] = [rollout_peer]
    config = inputs.config
    scrape: list[JSONDict] = []
    if config.metrics_scrape is not None:
        scraper = {"namespaceSelector": {"matchLabels": dict(config.metrics_scrape.namespace_labels)}}
        scrape = [{"from": [scraper], "ports": [{"protocol": "TCP", "port": HTTP_PORT}]}]
    if config.operator_namespace:
        inference_peers.append(
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.operator_namespace}},
                "podSelector": {"matchLabels": dict(config.operator_pod_labels)},
            }
        )

    def tcp(*ports: int) -> list[JSONDict]:
        return [{"protocol": "TCP", "port": port} for port in ports]

    def policy(suffix: str, pod_selector: JSONDict, ingress: list[JSONDict]) -> JSONDict:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(inputs, child_name(run, suffix), "network"),
            "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": ingress},
        }

    return [
        policy(
            "envs",
            {"matchLabels": selector(run, "env")},
            [{"from": [rollout_peer], "ports": tcp(HTTP_PORT, GRPC_PORT)}, *scrape],
        ),
        policy(
            "inference",
            {"matchLabels": selector(run, "inference")},
            [{"from": inference_peers, "ports": tcp(HTTP_PORT)}, *scrape],
        ),
        policy(
            "workers",
            {
                "matchLabels": {RUN_LABEL: run},
                "matchExpressions": [{"key": COMPONENT_LABEL, "operator": "In", "values": ["rollout", "trainer"]}],
            },
            [],
        ),
    ]


def checkpoint_claim_name(inputs: RunInputs) -> str:
    """The claim the trainer writes checkpoints to and inference reads them from: the spec's `volumeClaim`, else
    the run's own `<run>-checkpoints` (an emptyDir per pod would leave inference unable to load any of them)."""
    return inputs.run.spec.storage.volume_claim or child_name(inputs.name, "checkpoints")


def checkpoint_claim(inputs: RunInputs) -> JSONDict | None:
    """The PersistentVolumeClaim to create when it does not exist, for file checkpoints. A claim the spec names
    is never owned by the run (checkpoints outlive it, several runs may share it); the run's own default claim
    is (`reconcile` adopts it: deleting the run deletes it)."""
    storage = inputs.run.spec.storage
    if checkpoint_mount(storage.checkpoint_uri) is None:
        return None
    spec: JSONDict = {
        "accessModes": list(inputs.config.checkpoints.access_modes),
        "resources": {"requests": {"storage": storage.volume_size}},
    }
    if inputs.config.checkpoints.storage_class_name:
        spec["storageClassName"] = inputs.config.checkpoints.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": checkpoint_claim_name(inputs),
            "namespace": inputs.namespace,
            "labels": {"app.kubernetes.io/part-of": "agentgym", "app.kubernetes.io/managed-by": MANAGED_BY},
        },
        "spec": spec,
    }


def build_children(inputs: RunInputs) -> list[JSONDict]:
    """Every owned child of the run, in the order they are applied."""
    children = [spec_config_map(inputs), nats_secret(inputs)]
    if inputs.config.network_policies:
        children += network_policies(inputs)
    for env in inputs.run.spec.environments:
        if env.url is None:
            children += environment_children(inputs, env.name)
    children += inference_children(inputs)
    children.append(rollout_deployment(inputs))
    children.append(trainer_job(inputs))
    return children


def absent_children(inputs: RunInputs) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of owned children that must not exist in the current state."""
    absent: list[tuple[str, str, str]] = []
    if inputs.idle:
        for env in inputs.run.spec.environments:
            if env.url is None:
                absent.append(("autoscaling/v2", "HorizontalPodAutoscaler", env_name(inputs.name, env.name)))
    if not inputs.config.network_policies:
        for suffix in ("envs", "inference", "workers"):
            absent.append(("networking.k8s.io/v1", "NetworkPolicy", child_name(inputs.name, suffix)))
    return absent
