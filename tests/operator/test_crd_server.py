"""The generated TrainingRun CRD on a real Kubernetes CRD server (k8s.io/apiextensions-apiserver on etcd), and the
fidelity emulator agreeing with it case by case.

Each case runs on both servers with the same expected outcome, so a difference between the emulator (which the
operator's tests run against) and the real API server fails here, naming the case. The real server is built by
scripts/build-crd-server.sh (≈ 10 CPU-minutes once, cached outside the repository); where it is not built these
tests skip saying so (`make test-crd` builds it and runs them).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from crd_server import CrdServer, crd_server_binaries, running_crd_server
from operator_harness import PATHS, ApiError, Cluster

from agentgym.spec import API_GROUP
from agentgym.spec.crd import crd_document

pytestmark = pytest.mark.crd_server

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
_names = itertools.count()


def example_runs() -> list[dict[str, Any]]:
    """Every TrainingRun in examples/ (the study spec is not one)."""
    runs = [yaml.safe_load(path.read_text()) for path in sorted((ROOT / "examples").glob("*.yaml"))]
    return [run for run in runs if run.get("kind") == "TrainingRun"]


def quickstart() -> dict[str, Any]:
    """The quickstart under a name no other case uses (the real server is shared by the module's tests)."""
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    document["metadata"]["name"] = f"run-{next(_names)}"
    return document


@pytest.fixture(scope="module")
def crd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrdServer]:
    binaries = crd_server_binaries()
    if binaries is None:
        pytest.skip("the CRD server is not built here: `make test-crd` builds it (scripts/build-crd-server.sh)")
    with running_crd_server(binaries, tmp_path_factory.mktemp("crd-server")) as server:
        with httpx.Client(base_url=server.url, verify=server.client_ssl(), timeout=30) as client:
            created = client.post(CRD_PATH, json=crd_document())
            # 201 means the structural schema was accepted and every CEL rule compiled.
            assert created.status_code == 201, created.text
            deadline = time.monotonic() + 30
            while client.get(PATHS["TrainingRun"].format(ns="ml")).status_code != 200:
                assert time.monotonic() < deadline, server.logs()
                time.sleep(0.2)
        yield server


@pytest.fixture
async def real_cluster(crd_server: CrdServer) -> AsyncIterator[Cluster]:
    connector = aiohttp.TCPConnector(ssl=crd_server.client_ssl())
    async with aiohttp.ClientSession(crd_server.url, connector=connector) as session:
        yield Cluster(session)


@pytest.fixture(params=["emulator", "apiextensions-apiserver"])
def any_cluster(request: pytest.FixtureRequest) -> Cluster:
    fixture = "cluster" if request.param == "emulator" else "real_cluster"
    cluster: Cluster = request.getfixturevalue(fixture)
    return cluster


async def refusal(cluster: Cluster, obj: dict[str, Any], **params: str) -> tuple[int, list[str], str]:
    """Create `obj` expecting a refusal: the status code, the fields the causes name, the message."""
    async with cluster.session.post(cluster.path("TrainingRun"), json=obj, params=params) as response:
        body = await response.json(content_type=None)
        assert response.status >= 400, f"accepted: {body}"
        return response.status, sorted(named_fields(body)), body["message"]


def named_fields(status: dict[str, Any]) -> list[str]:
    """The fields a 422's causes name; the real server adds a cause naming none when it skipped CEL rules on an
    invalid object."""
    causes = (status.get("details") or {}).get("causes") or []
    return [cause["field"] for cause in causes if cause.get("field", "<nil>") != "<nil>"]


def test_the_crd_is_established(crd_server: CrdServer) -> None:
    with httpx.Client(base_url=crd_server.url, verify=crd_server.client_ssl()) as client:
        crd = client.get(f"{CRD_PATH}/trainingruns.{API_GROUP}").json()
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert "NonStructuralSchema" not in conditions
    assert crd["status"]["acceptedNames"]["kind"] == "TrainingRun"
    assert crd["status"]["storedVersions"] == ["v1alpha1"]


async def test_examples_are_accepted_with_the_same_defaults(cluster: Cluster, real_cluster: Cluster) -> None:
    runs = example_runs()
    assert len(runs) >= 7  # the quickstarts and every paper recipe
    for run in runs:
        run = copy.deepcopy(run)
        run["metadata"]["name"] = f"{run['metadata']['name']}-{next(_names)}"
        emulated = await cluster.create("TrainingRun", copy.deepcopy(run))
        real = await real_cluster.create("TrainingRun", copy.deepcopy(run))
        assert emulated["spec"] == real["spec"], run["metadata"]["name"]
        assert "status" not in real and real["metadata"]["generation"] == 1
        assert real["spec"]["algorithm"]["clipLow"] == 0.2  # a schema default, filled in by the server
        assert real["spec"]["telemetry"]["sampleRatio"] == 1.0  # `default: {}`, then the nested default


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(run: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = run
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return change


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def change(run: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = run
        for key in parents:
            node = node[key]
        del node[leaf]

    return change


INVALID = {
    "below a minimum": (_set("spec.algorithm.groupSize", 0), ["spec.algorithm.groupSize"]),
    "a negative temperature": (_set("spec.rollout.temperature", -1), ["spec.rollout.temperature"]),
    "not in an enum": (_set("spec.algorithm.name", "a2c"), ["spec.algorithm.name"]),
    "a wrong type": (_set("spec.rollout.tasksPerStep", "many"), ["spec.rollout.tasksPerStep"]),
    "a missing required field": (_drop("spec.model"), ["spec.model"]),
    "an unknown environment": (_set("spec.environments", [{"name": "chess"}]), ["spec.environments[0].name"]),
    "two bad fields": (
        lambda run: (_set("spec.algorithm.groupSize", 0)(run), _set("spec.model.dtype", "int4")(run)),
        ["spec.algorithm.groupSize", "spec.model.dtype"],
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
async def test_invalid_runs_are_refused_naming_the_fields(any_cluster: Cluster, case: str) -> None:
    change, fields = INVALID[case]
    run = quickstart()
    change(run)
    status, named, message = await refusal(any_cluster, run)
    assert (status, named) == (422, fields), message
    assert all(field in message for field in fields)


async def test_unknown_fields_are_pruned_or_refused_when_strict(any_cluster: Cluster) -> None:
    run = quickstart()
    run["spec"]["typo"] = 1
    run["spec"]["algorithm"]["groupsize"] = 4
    created = await any_cluster.create("TrainingRun", copy.deepcopy(run))
    assert "typo" not in created["spec"] and "groupsize" not in created["spec"]["algorithm"]  # pruned
    run["metadata"]["name"] += "-strict"
    status, _, message = await refusal(any_cluster, run, fieldValidation="Strict")
    assert status == 400  # the real server refuses while decoding, before validation
    assert 'unknown field "spec.algorithm.groupsize"' in message and 'unknown field "spec.typo"' in message


async def test_immutable_fields_refuse_changes_and_mutable_ones_bump_the_generation(any_cluster: Cluster) -> None:
    name = (await any_cluster.create("TrainingRun", quickstart()))["metadata"]["name"]
    for patch, field in [
        ({"spec": {"model": {"name": "other"}}}, "spec.model"),
        ({"spec": {"environments": [{"name": "textcraft"}]}}, "spec.environments"),
        ({"spec": {"rollout": {"temperature": 0.5}}}, "spec.rollout.temperature"),
    ]:
        with pytest.raises(ApiError) as refused:
            await any_cluster.patch("TrainingRun", name, patch)
        assert refused.value.status == 422
        assert [c["field"] for c in refused.value.body["details"]["causes"]] == [field]
        assert f"{field} cannot change during a run" in refused.value.body["message"]
    suspended = await any_cluster.patch("TrainingRun", name, {"spec": {"suspend": True}})
    assert suspended["spec"]["suspend"] is True and suspended["metadata"]["generation"] == 2


async def test_the_status_subresource(any_cluster: Cluster) -> None:
    run = quickstart()
    run["status"] = {"phase": "Succeeded"}
    created = await any_cluster.create("TrainingRun", run)
    name = created["metadata"]["name"]
    assert "status" not in created  # status is the status subresource's
    labelled = await any_cluster.patch(
        "TrainingRun", name, {"metadata": {"labels": {"a": "b"}}, "status": {"phase": "Running"}}
    )
    assert "status" not in labelled and labelled["metadata"]["generation"] == 1
    status = await any_cluster.patch(
        "TrainingRun", name, {"status": {"phase": "Running", "step": 3}, "spec": {"suspend": True}}, "status"
    )
    assert status["status"]["phase"] == "Running" and status["status"]["step"] == 3
    assert status["status"]["policyVersion"] == 0  # a status default
    assert status["spec"]["suspend"] is False and status["metadata"]["generation"] == 1
    with pytest.raises(ApiError) as invalid:
        await any_cluster.patch("TrainingRun", name, {"status": {"phase": "Exploded"}}, "status")
    assert invalid.value.status == 422
    assert named_fields(invalid.value.body) == ["status.phase"]


async def test_printer_columns(real_cluster: Cluster) -> None:
    name = (await real_cluster.create("TrainingRun", quickstart()))["metadata"]["name"]
    status = {"phase": "Running", "step": 3, "horizon": 6, "reward": 0.5}
    await real_cluster.patch("TrainingRun", name, {"status": status}, "status")
    async with real_cluster.session.get(real_cluster.path("TrainingRun", name), headers={"Accept": TABLE}) as response:
        table = await response.json()
    assert response.status == 200 and table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Phase", "Step", "Horizon", "Reward", "Age"]
    [row] = table["rows"]
    assert row["cells"][:5] == [name, "Running", 3, 6, 0.5]
