"""The operator's own configuration: images, default resources, where NATS and the OTel collector are.

The Helm chart renders it into a ConfigMap (`config.yaml`, camelCase keys) mounted into the operator
pod; `AGENTGYM_OPERATOR_CONFIG` (or `agentgym operator run --config`) points at it. Every field has a
default, so the operator also runs with no file at all (development).

NATS credentials for the platform's server never sit in the file: they come from the environment
(`NATS_USER` + `NATS_PASSWORD`, or `NATS_TOKEN`), which the chart fills from a Secret.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from agentgym.environments import ENVIRONMENTS
from agentgym.plan import VLLM_WEIGHT_TRANSFER_BACKEND
from agentgym.spec import ENVIRONMENT_NAMES, format_validation_error

CONFIG_ENV = "AGENTGYM_OPERATOR_CONFIG"
DEFAULT_TAG = "0.1.0"


class ConfigModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Resources(ConfigModel):
    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {k: dict(v) for k, v in (("requests", self.requests), ("limits", self.limits)) if v}


def _resources(cpu: str, memory: str, cpu_limit: str, memory_limit: str) -> Resources:
    return Resources(requests={"cpu": cpu, "memory": memory}, limits={"cpu": cpu_limit, "memory": memory_limit})


class EnvironmentDefaults(ConfigModel):
    image: str
    resources: Resources
    target_cpu_utilization: int = Field(default=70, ge=1, le=100)
    """HorizontalPodAutoscaler target (average CPU utilisation of the requests)."""
    shm_size: str | None = None
    """A memory-backed /dev/shm of this size (Chromium needs one)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of the service container."""


def _default_environments() -> dict[str, EnvironmentDefaults]:
    # Sizes come from the environment cards.
    pods = {name: card.resources for name, card in ENVIRONMENTS.items()}
    return {
        name: EnvironmentDefaults(
            image=f"agentgym/env-{name}:{DEFAULT_TAG}",
            resources=_resources(pod.cpu, pod.memory, pod.cpu_limit, pod.memory_limit),
            shm_size=pod.shm_size,
        )
        for name, pod in pods.items()
    }


class Images(ConfigModel):
    rollout: str = f"agentgym/rollout:{DEFAULT_TAG}"
    trainer: str = f"agentgym/trainer:{DEFAULT_TAG}"
    inference_cpu: str = f"agentgym/inference-cpu:{DEFAULT_TAG}"
    """The platform's HF engine (`engine: hf`)."""
    vllm: str = f"agentgym/inference-vllm:{DEFAULT_TAG}"
    """vLLM (pinned) with the platform's `disk` weight-transfer plugin: services/inference/vllm.Dockerfile."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    pull_secrets: list[str] = Field(default_factory=list)


class VllmSettings(ConfigModel):
    resources: Resources = Field(default_factory=lambda: _resources("4", "32Gi", "8", "64Gi"))
    weight_transfer_backend: str | None = VLLM_WEIGHT_TRANSFER_BACKEND
    """vLLM weight-transfer backend for hot reloads (`--weight-transfer-config`); None: rolling restarts only."""
    extra_args: list[str] = Field(default_factory=list)
    shm_size: str = "8Gi"


class HfSettings(ConfigModel):
    resources: Resources = Field(default_factory=lambda: _resources("2", "4Gi", "4", "8Gi"))
    gpu_resources: Resources = Field(default_factory=lambda: _resources("4", "16Gi", "8", "32Gi"))
    """Used instead of `resources` when the run gives the HF engine GPUs."""


class InferenceSettings(ConfigModel):
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    hf: HfSettings = Field(default_factory=HfSettings)
    load_timeout_seconds: float = Field(default=600.0, gt=0)
    """How long one replica may take to load a new policy version before the operator restarts it."""


class RolloutSettings(ConfigModel):
    resources: Resources = Field(default_factory=lambda: _resources("1", "2Gi", "2", "4Gi"))


class TrainerSettings(ConfigModel):
    resources: Resources = Field(default_factory=lambda: _resources("2", "8Gi", "4", "16Gi"))
    gpu_resources: Resources = Field(default_factory=lambda: _resources("8", "64Gi", "16", "128Gi"))
    """Per trainer pod when the run asks for GPUs (plus `nvidia.com/gpu`)."""
    backoff_limit: int = Field(default=4, ge=0)
    """Trainer pod restarts before the run is Failed (each restart resumes from the last checkpoint)."""
    shm_size: str = "16Gi"


class CheckpointSettings(ConfigModel):
    storage_class_name: str | None = None
    access_modes: list[str] = Field(default_factory=lambda: ["ReadWriteMany"])


class NatsSettings(ConfigModel):
    url: str = "nats://nats:4222"
    """The platform's NATS (credentials come from NATS_USER/NATS_PASSWORD or NATS_TOKEN)."""
    connect_timeout_seconds: float = Field(default=5.0, gt=0)


class MetricsScrape(ConfigModel):
    """A Prometheus scraping the run pods' own `/metrics` (environment services, inference)."""

    namespace_labels: dict[str, str] = Field(min_length=1)
    """Labels of the namespaces the scraper runs in: the run's network policies admit them on the HTTP port."""


class OperatorConfig(ConfigModel):
    images: Images = Field(default_factory=Images)
    environments: dict[str, EnvironmentDefaults] = Field(default_factory=_default_environments)
    inference: InferenceSettings = Field(default_factory=InferenceSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    checkpoints: CheckpointSettings = Field(default_factory=CheckpointSettings)
    nats: NatsSettings = Field(default_factory=NatsSettings)
    otlp_endpoint: str | None = None
    """The platform's OTel collector (OTLP/HTTP); a run's `telemetry.otlpEndpoint` wins."""
    network_policies: bool = True
    """Per run: env services reachable only from its rollout workers, inference from them and the operator."""
    metrics_scrape: MetricsScrape | None = None
    """When set: env and inference pods carry `prometheus.io/*` annotations and admit the scraper's namespaces."""
    operator_namespace: str | None = None
    """Where the operator runs (default: $POD_NAMESPACE); inference admits its weight-reload calls."""
    operator_pod_labels: dict[str, str] = Field(default_factory=lambda: {"app.kubernetes.io/component": "operator"})
    gpu_tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Applied to every run pod."""
    resync_seconds: float = Field(default=15.0, gt=0)
    """Drift check: every run is reconciled at least this often (recreates deleted children, refreshes status)."""

    def environment(self, name: str) -> EnvironmentDefaults:
        if name not in self.environments:
            raise KeyError(f"no defaults for environment {name!r} in the operator config")
        return self.environments[name]

    def platform_nats_url(self) -> str:
        """The platform's NATS URL with the credentials from the environment (never logged)."""
        token = os.environ.get("NATS_TOKEN")
        if token:
            return with_credentials(self.nats.url, token=token)
        user, password = os.environ.get("NATS_USER"), os.environ.get("NATS_PASSWORD")
        if user and password:
            return with_credentials(self.nats.url, user=user, password=password)
        return self.nats.url


def with_credentials(
    url: str, *, user: str | None = None, password: str | None = None, token: str | None = None
) -> str:
    """`nats://host:4222` + credentials -> `nats://user:password@host:4222` (or `nats://token@host:4222`)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    if token:
        userinfo = quote(token, safe="")
    elif user and password:
        userinfo = f"{quote(user, safe='')}:{quote(password, safe='')}"
    else:
        return url
    return urlunsplit((parts.scheme, f"{userinfo}@{host}", parts.path, parts.query, parts.fragment))


def redact(url: str) -> str:
    """A URL safe to log: credentials replaced by ***."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit((parts.scheme, "***@" + parts.netloc.rsplit("@", 1)[-1], parts.path, parts.query, ""))


class ConfigError(ValueError):
    pass


def load_config(path: str | Path | None = None) -> OperatorConfig:
    """Read the config file (`path`, else $AGENTGYM_OPERATOR_CONFIG, else defaults)."""
    chosen = path if path is not None else os.environ.get(CONFIG_ENV)
    data: Any = {}
    if chosen:
        try:
            data = yaml.safe_load(Path(chosen).read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ConfigError(f"cannot read the operator config {chosen}: {error}") from None
    try:
        config = OperatorConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"invalid operator config {chosen}: " + "; ".join(format_validation_error(error))) from None
    if config.operator_namespace is None and os.environ.get("POD_NAMESPACE"):
        config = config.model_copy(update={"operator_namespace": os.environ["POD_NAMESPACE"]})
    missing = sorted(set(ENVIRONMENT_NAMES) - set(config.environments))
    if missing:
        defaults = _default_environments()
        config.environments.update({name: defaults[name] for name in missing})
    return config
