"""The fidelity emulator behaves like an API server where the operator depends on it; the operator's
Kubernetes client maps its answers to typed errors."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml
from kube_emulator import FidelityKubernetesEmulator, matches_label_selector
from operator_harness import ApiError, Cluster

from agentgym.operator import kube
from agentgym.operator.kube import KubeClient, KubeError

ROOT = Path(__file__).resolve().parents[2]


def quickstart(name: str = "quickstart") -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    document["metadata"]["name"] = name
    return document


def config_map(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}


async def test_versions_generation_and_the_status_subresource(cluster: Cluster) -> None:
    created = await cluster.create("TrainingRun", quickstart())
    meta = created["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"]
    assert created["spec"]["algorithm"]["clipLow"] == 0.2  # schema defaults applied
    assert created["spec"]["telemetry"] == {"sampleRatio": 1.0}  # `default: {}` + nested defaults
    assert "status" not in created

    labelled = await cluster.patch(
        "TrainingRun", "quickstart", {"metadata": {"labels": {"a": "b"}}, "status": {"phase": "Running"}}
    )
    assert labelled["metadata"]["generation"] == 1  # metadata only
    assert int(labelled["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert "status" not in labelled  # the main resource ignores status

    status = await cluster.patch(
        "TrainingRun", "quickstart", {"status": {"phase": "Running"}, "spec": {"suspend": True}}, subresource="status"
    )
    assert status["status"]["phase"] == "Running" and status["status"]["step"] == 0  # status defaults applied
    assert status["spec"]["suspend"] is False  # the status subresource changes nothing else
    assert status["metadata"]["generation"] == 1

    changed = await cluster.patch("TrainingRun", "quickstart", {"spec": {"suspend": True}})
    assert changed["metadata"]["generation"] == 2 and changed["status"]["phase"] == "Running"
    same = await cluster.patch("TrainingRun", "quickstart", {"spec": {"suspend": True}})
    assert same["metadata"]["resourceVersion"] == changed["metadata"]["resourceVersion"]  # no-op: nothing written


async def test_preconditions_and_json_patch_tests(cluster: Cluster) -> None:
    created = await cluster.create("ConfigMap", config_map("c"))
    version = created["metadata"]["resourceVersion"]
    with pytest.raises(ApiError) as conflict:
        await cluster.patch("ConfigMap", "c", {"metadata": {"resourceVersion": "999"}, "data": {"k": "x"}})
    assert conflict.value.status == 409
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
        {"op": "add", "path": "/data/j", "value": "1"},
    ]
    headers = {"Content-Type": "application/json-patch+json"}
    async with cluster.session.patch(cluster.path("ConfigMap", "c"), json=ops, headers=headers) as response:
        assert response.status == 422
    ops[0]["value"] = version
    async with cluster.session.patch(cluster.path("ConfigMap", "c"), json=ops, headers=headers) as response:
        assert response.status == 200 and (await response.json())["data"] == {"k": "v", "j": "1"}
    with pytest.raises(ApiError) as exists:
        await cluster.create("ConfigMap", config_map("c"))
    assert exists.value.status == 409


async def test_finalizers_and_garbage_collection(cluster: Cluster) -> None:
    owner = await cluster.create(
        "ConfigMap", {**config_map("owner"), "metadata": {"name": "owner", "finalizers": ["x/y"]}}
    )
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    for name in ("child-1", "child-2"):
        child = config_map(name)
        child["metadata"]["ownerReferences"] = [reference]
        await cluster.create("ConfigMap", child)
    await cluster.create("ConfigMap", config_map("unrelated"))

    deleting = await cluster.delete("ConfigMap", "owner")
    assert deleting["metadata"]["deletionTimestamp"]
    assert await cluster.get("ConfigMap", "owner") is not None and await cluster.get("ConfigMap", "child-1") is not None
    with pytest.raises(ApiError) as refused:
        await cluster.patch("ConfigMap", "owner", {"metadata": {"finalizers": ["x/y", "new/one"]}})
    assert refused.value.status == 422
    await cluster.patch("ConfigMap", "owner", {"metadata": {"finalizers": None}})
    assert await cluster.get("ConfigMap", "owner") is None
    assert await cluster.get("ConfigMap", "child-1") is None and await cluster.get("ConfigMap", "child-2") is None
    assert await cluster.get("ConfigMap", "unrelated") is not None


async def test_label_selectors_on_lists(cluster: Cluster) -> None:
    await cluster.create("ConfigMap", config_map("a", app="x", tier="web"))
    await cluster.create("ConfigMap", config_map("b", app="x", tier="db"))
    await cluster.create("ConfigMap", config_map("c", app="y"))

    async def names(selector: str) -> list[str]:
        async with cluster.session.get(cluster.path("ConfigMap"), params={"labelSelector": selector}) as response:
            return sorted(item["metadata"]["name"] for item in (await response.json())["items"])

    assert await names("app=x") == ["a", "b"]
    assert await names("app=x,tier!=db") == ["a"]
    assert await names("tier in (db,cache)") == ["b"]
    assert await names("!tier") == ["c"]
    assert matches_label_selector({"a": "1"}, "a,b notin (2)")


async def test_watch_resumes_from_a_resource_version(cluster: Cluster) -> None:
    first = await cluster.create("ConfigMap", config_map("w1"))
    await cluster.create("ConfigMap", config_map("w2"))
    events: list[tuple[str, str]] = []

    async def watch() -> None:
        params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"]}
        async with cluster.session.get(cluster.path("ConfigMap"), params=params) as response:
            async for line in response.content:
                if line.strip():
                    event = json.loads(line)
                    events.append((event["type"], event["object"]["metadata"]["name"]))

    task = asyncio.create_task(watch())
    await cluster.wait_for(lambda: _true(bool(events)), what="the replayed event")
    await cluster.delete("ConfigMap", "w1")
    await cluster.wait_for(lambda: _true(len(events) >= 2), what="the live event")
    task.cancel()
    assert events == [("ADDED", "w2"), ("DELETED", "w1")]  # only what happened after the version, no gap


async def _true(value: bool) -> bool:
    return value


# CRD validation, pruning, strict decoding and immutable fields: test_crd_server.py, case by case against the real
# apiextensions-apiserver where it is built, and on this emulator always.


# -- the operator's client ---------------------------------------------------------------------------------------------


@pytest.fixture
async def client(api: FidelityKubernetesEmulator) -> AsyncIterator[KubeClient]:
    logins: list[int] = []

    def login() -> kopf.ConnectionInfo:
        logins.append(1)
        return kopf.ConnectionInfo(server=str(api.url).rstrip("/"), token=f"token-{len(logins)}")

    kube_client = KubeClient(login)
    yield kube_client
    await kube_client.close()


async def test_client_verbs_and_typed_errors(client: KubeClient) -> None:
    created = await client.create(
        {**config_map("k", app="z"), "metadata": {"name": "k", "namespace": "ml", "labels": {"app": "z"}}}
    )
    assert created["metadata"]["uid"]
    assert (await client.get(kube.CONFIGMAP, "ml", "k") or {})["data"] == {"k": "v"}
    assert await client.get(kube.CONFIGMAP, "ml", "missing") is None
    patched = await client.patch(kube.CONFIGMAP, "ml", "k", {"data": {"k": None, "n": "1"}})
    assert patched["data"] == {"n": "1"}
    assert [i["metadata"]["name"] for i in await client.list(kube.CONFIGMAP, "ml", {"app": "z"})] == ["k"]
    assert await client.list(kube.CONFIGMAP, "ml", {"app": "other"}) == []
    with pytest.raises(kube.Conflict) as conflict:
        await client.create({**config_map("k"), "metadata": {"name": "k", "namespace": "ml"}})
    assert conflict.value.temporary
    with pytest.raises(kube.NotFound):
        await client.patch(kube.CONFIGMAP, "ml", "missing", {"data": {}})
    run = quickstart()
    run["metadata"]["namespace"] = "ml"
    run["spec"]["rollout"]["temperature"] = -1
    with pytest.raises(KubeError) as invalid:
        await client.create(run)
    assert invalid.value.status == 422 and not invalid.value.temporary
    assert await client.delete(kube.CONFIGMAP, "ml", "k") is True
    assert await client.delete(kube.CONFIGMAP, "ml", "k") is False


async def test_client_logs_in_again_after_401(api: FidelityKubernetesEmulator, client: KubeClient) -> None:
    seen: list[str] = []

    async def reject_first(request: Any) -> Any:
        seen.append(request.headers.get("Authorization", ""))
        if len(seen) == 1:
            return kmock.Response(status=401, payload={"kind": "Status", "code": 401, "reason": "Unauthorized"})
        return kmock.Response(status=200, payload={"kind": "ConfigMap", "metadata": {"name": "x"}})

    api["get /api/v1/namespaces/auth/configmaps/x"] << reject_first
    assert (await client.get(kube.CONFIGMAP, "auth", "x") or {})["metadata"]["name"] == "x"
    assert seen == ["Bearer token-1", "Bearer token-2"]


async def test_client_connection_failure_is_temporary() -> None:
    dead = KubeClient(lambda: kopf.ConnectionInfo(server="http://127.0.0.1:9"))
    try:
        with pytest.raises(KubeError) as failure:
            await dead.get(kube.CONFIGMAP, "ml", "x")
        assert failure.value.status == 0 and failure.value.temporary
    finally:
        await dead.close()


def test_emulator_refuses_cel_it_cannot_evaluate() -> None:
    from kube_emulator import CustomResourceSchema

    schema = {
        "type": "object",
        "properties": {"spec": {"type": "object", "x-kubernetes-validations": [{"rule": "self.a < self.b"}]}},
    }
    with pytest.raises(NotImplementedError, match=r"self\.a < self\.b"):
        CustomResourceSchema.from_openapi(copy.deepcopy(schema))
