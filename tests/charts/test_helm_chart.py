"""The Helm chart, rendered and linted by the real Helm v4 SDK (helm-python-sdk), for several value sets.

Every rendered object must pass `kubernetes-validate --strict` at a current Kubernetes version; the
values schema must reject bad values naming the field; the operator config the chart renders must be
one the operator accepts, and the children it then builds for the examples must validate too.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kube_emulator import CustomResourceSchema, openapi_to_jsonschema

from agentgym.operator.config import OperatorConfig
from agentgym.operator.manifests import RunInputs, build_children, checkpoint_claim
from agentgym.spec import load_training_run

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "agentgym"
EXAMPLES = [p for p in sorted((ROOT / "examples").glob("*.yaml")) if "\nkind: TrainingRun" in p.read_text()]
KUBE_VERSION = "1.37.0"
RELEASE, NAMESPACE = "agentgym", "agentgym-system"

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "external-nats": {
        "nats": {"enabled": False},
        "messaging": {"external": {"url": "nats://nats.shared.svc:4222", "credentialsSecret": "shared-nats"}},
    },
    "otel-off": {"otel": {"collector": {"enabled": False}, "endpoint": ""}},
    "otel-external": {"otel": {"collector": {"enabled": False}, "endpoint": "http://tempo.observability:4318"}},
    "gpu-trainer": {
        "trainer": {
            "backoffLimit": 2,
            "gpuResources": {"requests": {"cpu": "32", "memory": "256Gi"}, "limits": {"cpu": "48", "memory": "384Gi"}},
        },
        "runPods": {
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "gpuTolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        "inference": {"vllm": {"weightTransferBackend": "", "extraArgs": ["--enforce-eager"]}},
    },
    "teams": {
        "operator": {"watchNamespaces": ["team-a", "team-b"]},
        "images": {"registry": "ghcr.io/acme", "tag": "1.2.3", "pullSecrets": ["regcred"]},
        "otel": {"collector": {"tracesEndpoint": "tempo.observability:4317"}},
    },
    "cluster-wide": {"operator": {"clusterWide": True}, "networkPolicies": {"enabled": False}},
    "observability": {
        "otel": {"jaeger": {"enabled": True, "maxTraces": 20000}},
        "grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "AgentGym"}}},
        "prometheus": {"scrapeRunPods": True, "namespaceLabels": {"kubernetes.io/metadata.name": "metrics"}},
    },
}


def render(values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Template path -> its objects (NOTES.txt and empty templates left out)."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    rendered = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        objects = [doc for doc in yaml.safe_load_all(text) if doc]
        if objects:
            rendered[path] = objects
    return rendered


def objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [obj for docs in render(values).values() for obj in docs]


def find(items: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in items if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"{kind}/{name}: {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def pod_specs(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if obj["kind"] == "Pod":
        yield obj["spec"]
    elif obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        yield obj["spec"]["template"]["spec"]


def operator_config(items: list[dict[str, Any]]) -> OperatorConfig:
    config_map = find(items, "ConfigMap", f"{RELEASE}-operator")
    return OperatorConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))


@pytest.fixture(scope="module")
def rendered_sets() -> dict[str, list[dict[str, Any]]]:
    return {name: objects(values) for name, values in VALUE_SETS.items()}


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict_is_clean(name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_validates_strictly(name: str, rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    items = rendered_sets[name]
    assert len(items) >= 8
    for obj in items:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_the_crd_is_packaged_and_valid() -> None:
    with helm.Chart.load(CHART) as chart:
        crds = chart.crds
    assert [c["name"] for c in crds] == ["crds/trainingruns.yaml"]
    crd = yaml.safe_load(crds[0]["data"])
    kubernetes_validate.validate(crd, KUBE_VERSION, strict=True)
    assert crd["metadata"]["name"] == "trainingruns.agentgym.io"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_are_hardened(name: str, rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    for obj in rendered_sets[name]:
        for spec in pod_specs(obj):
            where = f"{obj['kind']}/{obj['metadata']['name']}"
            assert spec["securityContext"]["runAsNonRoot"] is True, where
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            for container in spec["containers"]:
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False, where
                assert context["readOnlyRootFilesystem"] is True, where
                assert context["capabilities"]["drop"] == ["ALL"], where
                assert container.get("resources") is not None, where


def test_rbac_is_least_privilege(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    items = rendered_sets["default"]
    role = find(items, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    grants = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert grants[("agentgym.io", "trainingruns")] == {"get", "list", "watch", "patch"}
    assert grants[("agentgym.io", "trainingruns/status")] == {"get", "patch"}
    assert grants[("", "pods")] == {"list"}
    assert grants[("", "secrets")] == {"get", "create", "patch", "delete"}
    assert grants[("", "persistentvolumeclaims")] == {"get", "create"}
    for (group, resource), verbs in grants.items():
        assert "*" not in verbs and resource != "*" and group != "*"
        if resource not in ("trainingruns",):
            assert not verbs & {"watch", "deletecollection", "escalate", "bind", "impersonate"}, resource
    assert not [o for o in items if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = find(items, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{RELEASE}-operator", "namespace": NAMESPACE}]
    deployment = find(items, "Deployment", f"{RELEASE}-operator")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == f"{RELEASE}-operator"
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}

    teams = rendered_sets["teams"]
    assert sorted(r["metadata"]["namespace"] for r in teams if r["kind"] == "Role") == ["team-a", "team-b"]
    command = find(teams, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--namespace") :] == ["--namespace", "team-a", "--namespace", "team-b"]

    wide = rendered_sets["cluster-wide"]
    assert find(wide, "ClusterRole")["rules"] == role["rules"]
    assert not [o for o in wide if o["kind"] == "Role"]
    assert (
        "--all-namespaces"
        in find(wide, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]["containers"][0]["command"]
    )


def test_network_policies(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    items = rendered_sets["default"]
    nats_policy = find(items, "NetworkPolicy", f"{RELEASE}-nats")
    statefulset = find(items, "StatefulSet")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    selected = nats_policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= pod_labels.items(), "the NATS policy must select the NATS pods"
    clients = nats_policy["spec"]["ingress"][0]
    assert clients["from"][0]["podSelector"] == {"matchLabels": {"agentgym.io/nats-client": "true"}}
    assert clients["ports"] == [{"protocol": "TCP", "port": 4222}]
    operator_pod = find(items, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["metadata"]["labels"]
    assert operator_pod["agentgym.io/nats-client"] == "true"
    test_pod = find(items, "Pod")["metadata"]["labels"]
    assert test_pod["agentgym.io/nats-client"] == "true" and test_pod["agentgym.io/platform"] == "true"
    assert operator_config(items).network_policies is True

    assert not [o for o in rendered_sets["external-nats"] if o["metadata"]["name"] == f"{RELEASE}-nats"]
    wide = rendered_sets["cluster-wide"]
    assert not [o for o in wide if o["kind"] == "NetworkPolicy"]
    assert operator_config(wide).network_policies is False


def test_nats_is_authenticated_and_wired(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    items = rendered_sets["default"]
    secret = find(items, "Secret", f"{RELEASE}-nats-auth")
    assert base64.b64decode(secret["data"]["user"]).decode() == "agentgym"
    assert len(base64.b64decode(secret["data"]["password"]).decode()) == 32
    nats_conf = find(items, "ConfigMap", f"{RELEASE}-nats-config")["data"]["nats.conf"]
    assert '"user": $NATS_USER' in nats_conf and '"password": $NATS_PASSWORD' in nats_conf
    assert '"store_dir": "/data"' in nats_conf  # JetStream on a volume
    server = find(items, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in server["env"]
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    }
    assert refs == {
        "NATS_USER": {"name": secret["metadata"]["name"], "key": "user"},
        "NATS_PASSWORD": {"name": secret["metadata"]["name"], "key": "password"},
    }
    service = find(items, "Service", f"{RELEASE}-nats")
    config = operator_config(items)
    assert config.nats.url == f"nats://{service['metadata']['name']}.{NAMESPACE}.svc:4222"
    operator_env = {
        e["name"]: e
        for e in find(items, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert operator_env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]

    external = rendered_sets["external-nats"]
    assert not [o for o in external if o["kind"] == "StatefulSet"]
    assert operator_config(external).nats.url == "nats://nats.shared.svc:4222"
    env = {
        e["name"]: e
        for e in find(external, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["NATS_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "shared-nats", "key": "token", "optional": True}


def test_otel_wiring(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    items = rendered_sets["default"]
    collector = find(items, "Service", f"{RELEASE}-otel-collector")
    assert operator_config(items).otlp_endpoint == f"http://{collector['metadata']['name']}.{NAMESPACE}.svc:4318"
    pipelines = yaml.safe_load(find(items, "ConfigMap", f"{RELEASE}-otel-collector")["data"]["collector.yaml"])
    assert pipelines["service"]["pipelines"]["traces"]["exporters"] == ["debug"]
    teams = yaml.safe_load(
        find(rendered_sets["teams"], "ConfigMap", f"{RELEASE}-otel-collector")["data"]["collector.yaml"]
    )
    assert teams["exporters"]["otlp/traces"]["endpoint"] == "tempo.observability:4317"
    assert teams["service"]["pipelines"]["traces"]["exporters"] == ["otlp/traces", "debug"]

    off = rendered_sets["otel-off"]
    assert not [o for o in off if "otel-collector" in o["metadata"]["name"]]
    assert operator_config(off).otlp_endpoint is None
    assert operator_config(rendered_sets["otel-external"]).otlp_endpoint == "http://tempo.observability:4318"


def test_bundled_jaeger_takes_the_collectors_traces(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    items = rendered_sets["observability"]
    jaeger = find(items, "Service", f"{RELEASE}-jaeger")
    pipelines = yaml.safe_load(find(items, "ConfigMap", f"{RELEASE}-otel-collector")["data"]["collector.yaml"])
    assert pipelines["exporters"]["otlp/traces"]["endpoint"] == f"{jaeger['metadata']['name']}.{NAMESPACE}.svc:4317"
    assert pipelines["service"]["pipelines"]["traces"]["exporters"] == ["otlp/traces", "debug"]
    config = yaml.safe_load(find(items, "ConfigMap", f"{RELEASE}-jaeger")["data"]["jaeger.yaml"])
    assert config["extensions"]["jaeger_storage"]["backends"]["memstore"]["memory"]["max_traces"] == 20000
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    deployment = find(items, "Deployment", f"{RELEASE}-jaeger")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "jaegertracing/jaeger:2.11.0" and deployment["spec"]["strategy"]["type"] == "Recreate"
    policy = find(items, "NetworkPolicy", f"{RELEASE}-jaeger")
    otlp_from = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert otlp_from["app.kubernetes.io/component"] == "otel-collector"
    # A tracesEndpoint the user gives wins over the bundled Jaeger; off by default.
    assert not [o for o in rendered_sets["default"] if "jaeger" in o["metadata"]["name"]]
    both = objects({"otel": {"jaeger": {"enabled": True}, "collector": {"tracesEndpoint": "tempo.obs:4317"}}})
    chosen = yaml.safe_load(find(both, "ConfigMap", f"{RELEASE}-otel-collector")["data"]["collector.yaml"])
    assert chosen["exporters"]["otlp/traces"]["endpoint"] == "tempo.obs:4317"


def _exported_metric_names() -> set[str]:
    """Every Prometheus series name the platform exports: the services' own registries, and the trainer's gauges
    (OpenTelemetry `agentgym.trainer.<key>`, which the collector's Prometheus exporter writes with underscores)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from agentgym.envs.server.manager import ServiceMetrics
    from agentgym.inference.metrics import InferenceMetrics
    from agentgym.trainer.metrics import MetricsSink, rollout_metrics
    from agentgym.trainer.rewards import RewardConfig

    names = set()
    for registry in (ServiceMetrics("babyai").registry, InferenceMetrics().registry):
        names |= {sample.name for family in registry.collect() for sample in family.samples}
        names |= {family.name for family in registry.collect()}
    reader = InMemoryMetricReader()
    with tempfile.TemporaryDirectory() as directory:
        sink = MetricsSink(directory, "r", tensorboard=False, meter_provider=MeterProvider(metric_readers=[reader]))
        # The step record's shape (trainer/agentgym/trainer/step.py): top-level step facts and per-env stats.
        record = {"policy_version": 1, "horizon": 5, "staleness_mean": 0.0, "step_time_s": 1.0,
                  "env": rollout_metrics([], RewardConfig())}  # fmt: skip
        sink.write(0, {"step": 0, **record})
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            names |= {metric.name.replace(".", "_") for metric in scope.metrics}
    return names


def test_grafana_dashboard_charts_metrics_the_platform_exports(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    config_map = find(rendered_sets["observability"], "ConfigMap", f"{RELEASE}-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "AgentGym"}
    dashboard = json.loads(config_map["data"]["agentgym.json"])
    assert dashboard["uid"] == "agentgym-platform"
    titles = {panel["title"] for panel in dashboard["panels"]}
    for wanted in ("Training steps per second", "Episodes in flight", "Live episodes per environment service",
                   "Turn latency", "Reward (mean per step)", "Success rate", "Horizon (max turns) and turns used",
                   "Policy version lag"):  # fmt: skip
        assert wanted in titles
    exported = _exported_metric_names()
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"agentgym_[a-z_]+", target["expr"])}  # fmt: skip
    assert queried and queried <= exported, sorted(queried - exported)
    assert not [o for o in rendered_sets["default"] if o["metadata"]["name"].endswith("grafana-dashboard")]


def test_scraping_the_run_pods_annotates_them_and_opens_their_policies(
    rendered_sets: dict[str, list[dict[str, Any]]],
) -> None:
    config = operator_config(rendered_sets["observability"])
    assert config.metrics_scrape is not None
    assert config.metrics_scrape.namespace_labels == {"kubernetes.io/metadata.name": "metrics"}
    assert operator_config(rendered_sets["default"]).metrics_scrape is None
    collector = find(rendered_sets["default"], "Deployment", f"{RELEASE}-otel-collector")
    assert collector["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8889"


def test_images_follow_registry_and_tag(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    config = operator_config(rendered_sets["teams"])
    assert config.images.rollout == "ghcr.io/acme/agentgym/rollout:1.2.3"
    assert config.environments["sciworld"].image == "ghcr.io/acme/agentgym/env-sciworld:1.2.3"
    assert config.images.pull_secrets == ["regcred"]
    operator = find(rendered_sets["teams"], "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]
    assert operator["containers"][0]["image"] == "ghcr.io/acme/agentgym/operator:1.2.3"
    assert operator["imagePullSecrets"] == [{"name": "regcred"}]
    default = operator_config(rendered_sets["default"])
    assert default.images.trainer == "agentgym/trainer:0.1.0"
    assert default.environments["webarena"].shm_size == "1Gi"


def test_helm_test_hook_checks_operator_and_nats(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    items = rendered_sets["default"]
    pod = find(items, "Pod", f"{RELEASE}-test-platform")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    command = pod["spec"]["containers"][0]["command"]
    assert command[:3] == ["agentgym", "operator", "check"]
    service = find(items, "Service", f"{RELEASE}-operator")
    assert service["spec"]["ports"][0]["port"] == 8080
    assert command[command.index("--operator-url") + 1] == f"http://{RELEASE}-operator.{NAMESPACE}.svc:8080/healthz"
    assert command[command.index("--nats-url") + 1] == operator_config(items).nats.url
    liveness = find(items, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert liveness[liveness.index("--liveness") + 1] == "http://0.0.0.0:8080/healthz"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"operator": {"replicas": 2}}, "/operator/replicas"),
        ({"operator": {"replica": 1}}, "replica"),
        ({"nats": {"enabled": False}}, "/messaging/external/url"),
        ({"images": {"pullPolicy": "Sometimes"}}, "/images/pullPolicy"),
        (
            {"environments": {"babyai": {"image": "agentgym/env-babyai", "resources": {"limits": {"cpu": "lots"}}}}},
            "/environments/babyai/resources/limits/cpu",
        ),
        ({"operator": {"clusterWide": True, "watchNamespaces": ["a"]}}, "/operator/watchNamespaces"),
        ({"messaging": {"auth": {"password": "short"}}}, "/messaging/auth/password"),
        ({"otel": {"endpoint": "tempo:4318"}}, "/otel/endpoint"),
        ({"checkpoints": {"accessModes": ["ReadWriteAlways"]}}, "/checkpoints/accessModes/0"),
    ],
)
def test_schema_rejects_invalid_values(values: dict[str, Any], field: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as rejected:
        chart.validate_schema(values)
    assert field in str(rejected.value)
    with pytest.raises(helm.HelmError):
        render(values)


def test_schema_accepts_every_value_set() -> None:
    with helm.Chart.load(CHART) as chart:
        for values in VALUE_SETS.values():
            chart.validate_schema(copy.deepcopy(values))


@pytest.mark.parametrize("name", ["default", "gpu-trainer"])
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_children_of_examples_validate_with_the_rendered_config(
    name: str, example: Path, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    config = operator_config(rendered_sets[name])
    run = load_training_run(example)
    inputs = RunInputs(run=run, namespace="ml", config=config, nats_url=config.nats.url)
    children = build_children(inputs)
    claim = checkpoint_claim(inputs)
    for child in [*children, *([claim] if claim else [])]:
        kubernetes_validate.validate(child, KUBE_VERSION, strict=True)
    job = next(c for c in children if c["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    if run.spec.trainer.gpus:
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(run.spec.trainer.gpus)
        assert pod["tolerations"] == [dict(t) for t in config.gpu_tolerations]
        if name == "gpu-trainer":
            assert pod["containers"][0]["resources"]["limits"]["memory"] == "384Gi"
            assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert job["spec"]["backoffLimit"] == 2


# ---------------------------------------------------------------------------------------------------------------------
# TrainingRuns against the CRD the chart ships


def chart_crd_schema() -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        crd = yaml.safe_load(chart.crds[0]["data"])
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_validate_against_the_chart_crd(example: Path) -> None:
    schema = CustomResourceSchema.from_openapi(chart_crd_schema())
    document = yaml.safe_load(example.read_text())
    assert schema.validate(document) == []
    assert schema.unknown_fields(document) == []


@pytest.mark.parametrize(
    ("patch", "field", "message"),
    [
        ({"algorithm": {"groupSize": 0}}, "spec.algorithm.groupSize", "less than the minimum of 1"),
        ({"inference": {"engine": "tgi"}}, "spec.inference.engine", "'tgi' is not one of"),
        ({"environments": [{"name": "chess"}]}, "spec.environments[0].name", "'chess' is not one of"),
        ({"rollout": {"temperature": -1}}, "spec.rollout.temperature", "less than the minimum of 0"),
    ],
)
def test_an_invalid_training_run_is_rejected_naming_the_field(patch: dict[str, Any], field: str, message: str) -> None:
    schema = CustomResourceSchema.from_openapi(chart_crd_schema())
    document = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    document["spec"].update(patch)
    causes = schema.validate(document)
    assert any(c["field"] == field and message in c["message"] for c in causes), causes
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, _draft4(chart_crd_schema()))


def test_immutable_fields_carry_cel_rules() -> None:
    schema = CustomResourceSchema.from_openapi(chart_crd_schema())
    paths = {".".join(path) for path, _ in schema.immutable}
    for field in ("model", "environments", "algorithm", "curriculum", "trainer", "storage", "messaging"):
        assert f"spec.{field}" in paths
    assert "spec.rollout.temperature" in paths and "spec.rollout.workers" not in paths
    assert "spec.inference" not in paths and "spec.suspend" not in paths
    old = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    new = copy.deepcopy(old)
    new["spec"]["trainer"]["totalSteps"] = 999
    new["spec"]["rollout"]["workers"] = 4
    assert [c["field"] for c in schema.transition_errors(old, new)] == ["spec.trainer"]


def _draft4(openapi: dict[str, Any]) -> dict[str, Any]:
    converted: dict[str, Any] = openapi_to_jsonschema(openapi)
    converted["$schema"] = "http://json-schema.org/draft-04/schema#"
    return converted


def test_notes_tell_how_to_use_the_release() -> None:
    with helm.Chart.load(CHART) as chart:
        notes = chart.render({}, name=RELEASE, namespace=NAMESPACE, is_install=True)[f"{RELEASE}/templates/NOTES.txt"]
    assert f"helm test {RELEASE} -n {NAMESPACE}" in notes
    assert f"kubectl apply -n {NAMESPACE}" in notes and "kubectl get trainingruns -w" in notes
