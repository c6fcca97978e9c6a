"""Operator parts on their own: status conditions, weight rolling (over HTTP), NATS control, config, patches, CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import pytest
import yaml
from operator_harness import FakeEngine
from typer.testing import CliRunner

from agentgym.cli.main import app
from agentgym.lifecycle import JobState, Observed, Replicas, compute_status, curriculum_status, weights_status
from agentgym.messaging import EmbeddedNats
from agentgym.operator.checks import check_platform
from agentgym.operator.config import ConfigError, OperatorConfig, load_config, redact, with_credentials
from agentgym.operator.handlers import backoff
from agentgym.operator.manifests import Checkpoint
from agentgym.operator.reconcile import child_patch
from agentgym.operator.weights import (
    HfWeightRoller,
    Replica,
    VllmWeightRoller,
    WeightLoadError,
    ready_replicas,
    sync_replicas,
)
from agentgym.proto import rl_pb2

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def conditions_of(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


# -- conditions --------------------------------------------------------------------------------------------------------


def test_status_of_a_healthy_run() -> None:
    observed = Observed(
        environments={"babyai": Replicas(2, 2)},
        inference=Replicas(1, 1),
        job=JobState(active=1),
        policy_version=5,
        served_policy_version=5,
    )
    status = compute_status(observed, generation=3, now=NOW)
    conditions = conditions_of(status)
    assert status["phase"] == "Running" and status["observedGeneration"] == 3
    assert conditions["Ready"]["status"] == "True"
    assert conditions["InferenceReady"]["message"] == "1 replicas serve v5"
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == NOW for c in conditions.values())


def test_stale_weights_within_max_staleness_are_ready() -> None:
    base = {"environments": {"babyai": Replicas(1, 1)}, "inference": Replicas(1, 1), "job": JobState(active=1)}
    stale = compute_status(Observed(**base, policy_version=5, served_policy_version=3), generation=1, now=NOW)
    assert conditions_of(stale)["InferenceReady"]["reason"] == "WeightsStale"
    assert conditions_of(stale)["Ready"]["reason"] == "WeightsStale"
    relaxed = Observed(**base, policy_version=5, served_policy_version=3, max_staleness=2)
    assert conditions_of(compute_status(relaxed, generation=1, now=NOW))["InferenceReady"]["status"] == "True"


def test_transition_times_move_only_on_flips() -> None:
    waiting = Observed(environments={"babyai": Replicas(0, 1)}, inference=Replicas(0, 1), job=JobState())
    first = compute_status(waiting, generation=1, now=NOW)
    again = compute_status(waiting, generation=1, previous=first["conditions"], now=LATER)
    assert conditions_of(again)["EnvironmentsReady"]["lastTransitionTime"] == NOW
    ready = Observed(environments={"babyai": Replicas(1, 1)}, inference=Replicas(0, 1), job=JobState())
    flipped = compute_status(ready, generation=1, previous=first["conditions"], now=LATER)
    assert conditions_of(flipped)["EnvironmentsReady"]["lastTransitionTime"] == LATER
    assert conditions_of(flipped)["InferenceReady"]["lastTransitionTime"] == NOW


def test_completion_failure_suspension_and_invalid_spec() -> None:
    done = compute_status(Observed(job=JobState(succeeded=True)), generation=1, now=NOW)
    assert done["phase"] == "Succeeded" and conditions_of(done)["Complete"]["status"] == "True"
    failed = compute_status(
        Observed(
            job=JobState(
                failed=True, reason="BackoffLimitExceeded", message="Job has reached the specified backoff limit"
            )
        ),
        generation=1,
        now=NOW,
    )
    assert failed["phase"] == "Failed" and conditions_of(failed)["Failed"]["reason"] == "BackoffLimitExceeded"
    suspended = compute_status(Observed(suspended=True, job=JobState()), generation=2, now=NOW)
    assert suspended["phase"] == "Suspended" and conditions_of(suspended)["Suspended"]["status"] == "True"
    invalid = compute_status(Observed(), generation=4, now=NOW, invalid_spec=["spec.inference: bad"])
    assert invalid["phase"] == "Failed"
    assert conditions_of(invalid)["Failed"] == {
        "type": "Failed",
        "status": "True",
        "reason": "InvalidSpec",
        "message": "spec.inference: bad",
        "lastTransitionTime": NOW,
        "observedGeneration": 4,
    }
    problem = compute_status(
        Observed(problem=("NatsUnavailable", "down"), job=JobState(active=1)), generation=1, now=NOW
    )
    assert conditions_of(problem)["Ready"]["reason"] == "NatsUnavailable"


def test_job_state_from_a_job() -> None:
    job = {
        "status": {"failed": 5, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    }
    state = JobState.of(job)
    assert state is not None and state.failed and state.finished and state.reason == "BackoffLimitExceeded"
    assert JobState.of({"status": {"succeeded": 1}}) == JobState(succeeded=True)
    assert JobState.of(None) is None


# -- weights -----------------------------------------------------------------------------------------------------------


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_hf_roller_loads_and_reports(engines: list[FakeEngine], http: aiohttp.ClientSession) -> None:
    roller = HfWeightRoller(http, timeout=5)
    endpoint = f"http://127.0.0.1:{engines[0].port}"
    assert await roller.served_version(endpoint) == 0
    await roller.load(endpoint, Checkpoint(2, "file:///ckpt/v2"))
    assert engines[0].loads == [{"uri": "file:///ckpt/v2", "version": 2}]
    assert await roller.served_version(endpoint) == 2
    engines[0].fail_loads = True
    with pytest.raises(WeightLoadError, match=r"400.*still serving policy version 2"):
        await roller.load(endpoint, Checkpoint(3, "file:///ckpt/v3"))
    assert await roller.served_version("http://127.0.0.1:9") is None  # unreachable: unknown


async def test_sync_replicas_reloads_only_the_ones_behind(
    engines: list[FakeEngine], http: aiohttp.ClientSession
) -> None:
    engines[0].version = 4  # already there
    replicas = [
        Replica("a", f"http://127.0.0.1:{engines[0].port}", 0),
        Replica("b", f"http://127.0.0.1:{engines[1].port}", 0),
        Replica("c", "http://127.0.0.1:9", 4),  # unreachable, but started on v4 (pod annotation)
    ]
    result = await sync_replicas(HfWeightRoller(http, timeout=5), replicas, Checkpoint(4, "file:///ckpt/v4"))
    assert result.served == 4 and result.reloaded == ["b"] and result.failed == {}
    assert engines[0].loads == [] and engines[1].loads == [{"uri": "file:///ckpt/v4", "version": 4}]

    engines[1].fail_loads = True
    result = await sync_replicas(HfWeightRoller(http, timeout=5), replicas[:2], Checkpoint(5, "file:///ckpt/v5"))
    assert result.served == 4 and result.reloaded == ["a"] and list(result.failed) == ["b"]
    assert (await sync_replicas(HfWeightRoller(http, timeout=5), [], Checkpoint(5, "x"))).served is None


async def test_vllm_roller_drives_the_weight_transfer_routes(http: aiohttp.ClientSession) -> None:
    calls: list[tuple[str, Any]] = []
    state = {"version": None}

    async def record(request: aiohttp.web.Request) -> aiohttp.web.Response:
        body = await request.json() if request.can_read_body else None
        calls.append((request.path_qs, body))
        if request.path == "/finish_weight_update":
            state["version"] = body["weight_version"]
        return aiohttp.web.json_response({"message": "ok"})

    async def weight_info(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"weight_version": state["version"]})

    app = aiohttp.web.Application()
    for route in (
        "/init_weight_transfer_engine",
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/resume",
    ):
        app.router.add_post(route, record)
    app.router.add_get("/weight_info", weight_info)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    endpoint = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        roller = VllmWeightRoller(http, timeout=5)
        assert await roller.served_version(endpoint) is None
        await roller.load(endpoint, Checkpoint(9, "file:///checkpoints/run/v9"))
        assert calls == [
            ("/init_weight_transfer_engine", {"init_info": {}}),
            ("/pause?mode=wait", None),
            ("/start_weight_update", None),
            ("/update_weights", {"update_info": {"path": "/checkpoints/run/v9"}}),
            ("/finish_weight_update", {"weight_version": "9"}),
            ("/resume", None),
        ]
        assert await roller.served_version(endpoint) == 9
        with pytest.raises(WeightLoadError, match="directory every replica mounts"):
            await roller.load(endpoint, Checkpoint(10, "s3://bucket/v10"))
    finally:
        await runner.cleanup()


def test_ready_replicas_from_pods() -> None:
    def pod(name: str, **status: Any) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "annotations": {"agentgym.io/policy-version": "3"}},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {
                "phase": "Running",
                "podIP": "10.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
                **status,
            },
        }

    pods = [
        pod("ok"),
        pod("not-ready", conditions=[{"type": "Ready", "status": "False"}]),
        pod("pending", phase="Pending"),
        pod("no-ip", podIP=None),
        {**pod("leaving"), "metadata": {"name": "leaving", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
    ]
    assert ready_replicas(pods) == [Replica("ok", "http://10.0.0.1:8000", 3)]


# -- NATS control, config, patches ----------------------------------------------------------------------------------


def test_control_messages_to_status() -> None:
    state = rl_pb2.CurriculumState(run="r", step=7, stage=2, horizon=13)
    state.metrics.update({"success_rate": 0.25, "truncation_rate": 0.5})
    patch = curriculum_status(state, previous_metrics={"reward_mean": 0.1, "success_rate": 0.2})
    assert patch == {
        "step": 7,
        "stage": 2,
        "horizon": 13,
        "metrics": {"reward_mean": None, "success_rate": 0.25, "truncation_rate": 0.5},
        "reward": 0.25,
    }
    assert weights_status(rl_pb2.WeightUpdate(version=3, uri="s3://b/v3")) == {
        "policyVersion": 3,
        "lastCheckpoint": "s3://b/v3",
    }


def test_credentials_in_urls_and_redaction(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        with_credentials("nats://nats:4222", user="agent gym", password="p@ss") == "nats://agent%20gym:p%40ss@nats:4222"
    )
    assert with_credentials("nats://old:x@nats:4222", token="t0k") == "nats://t0k@nats:4222"
    assert with_credentials("nats://nats:4222") == "nats://nats:4222"
    assert redact("nats://user:secret@nats:4222") == "nats://***@nats:4222"
    monkeypatch.setenv("NATS_USER", "agentgym")
    monkeypatch.setenv("NATS_PASSWORD", "s3cret")
    monkeypatch.delenv("NATS_TOKEN", raising=False)
    assert OperatorConfig().platform_nats_url() == "nats://agentgym:s3cret@nats:4222"


def test_config_file_errors_name_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"resyncSeconds": 0, "images": {"pullPolicy": "Sometimes"}}))
    with pytest.raises(ConfigError, match=r"resyncSeconds.*|images\.pullPolicy"):
        load_config(path)
    path.write_text(yaml.safe_dump({"environments": {"babyai": {"image": "mine/babyai:1", "resources": {}}}}))
    monkeypatch.setenv("POD_NAMESPACE", "platform")
    config = load_config(path)
    assert config.environments["babyai"].image == "mine/babyai:1"
    assert config.environments["webarena"].image == "agentgym/env-webarena:0.1.0"  # filled in
    assert config.operator_namespace == "platform"


def test_patches_respect_hpa_and_job_immutability() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "r-env-babyai", "labels": {"app.kubernetes.io/component": "env"}},
        "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "env", "image": "new"}]}}},
    }
    live = {
        "metadata": {"name": "r-env-babyai"},
        "spec": {"replicas": 5, "template": {"spec": {"containers": [{"name": "env", "image": "old"}]}}},
    }
    patch = child_patch(deployment, live)
    assert patch is not None and "replicas" not in patch["spec"]  # the HPA owns it
    assert child_patch(deployment, {**live, "spec": {**live["spec"], "replicas": 0}})["spec"]["replicas"] == 1  # type: ignore[index]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "t", "labels": {}},
        "spec": {"suspend": True, "template": {}},
    }
    assert child_patch(job, {"metadata": {"labels": {}}, "spec": {"suspend": False}}) == {
        "metadata": {"labels": {}},
        "spec": {"suspend": True},
    }
    finished = {"metadata": {"labels": {}}, "spec": {"suspend": False}, "status": {"succeeded": 1}}
    assert child_patch(job, finished) is None
    assert (
        child_patch(
            deployment,
            {
                "metadata": {"labels": {"app.kubernetes.io/component": "env"}},
                **{k: v for k, v in deployment.items() if k == "spec"},
            },
        )
        is None
    )


def test_backoff_grows_and_is_capped() -> None:
    assert [backoff(r) for r in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(40) == 300.0


# -- CLI --------------------------------------------------------------------------------------------------------------


async def test_platform_check_passes_and_fails(tmp_path: Path) -> None:
    async def healthz(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({})

    app_ = aiohttp.web.Application()
    app_.router.add_get("/healthz", healthz)
    runner = aiohttp.web.AppRunner(app_)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    health = f"http://127.0.0.1:{runner.addresses[0][1]}/healthz"
    try:
        with EmbeddedNats(tmp_path / "nats") as server:
            assert await check_platform(health, server.url, timeout=5) == []
            problems = await check_platform(health.replace("healthz", "nothing"), server.url, timeout=5)
            assert len(problems) == 1 and "answered 404" in problems[0]
        problems = await check_platform(health, server.url, timeout=2)
        assert len(problems) == 1 and "NATS" in problems[0] and "unreachable" in problems[0]
    finally:
        await runner.cleanup()


def test_render_command_prints_the_children() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    result = CliRunner().invoke(app, ["operator", "render", str(example), "--namespace", "ml"])
    assert result.exit_code == 0, result.output
    documents = list(yaml.safe_load_all(result.stdout))
    assert {d["kind"] for d in documents} >= {"Deployment", "Job", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
    assert all(d["metadata"]["namespace"] == "ml" for d in documents)
    bad = CliRunner().invoke(app, ["operator", "render", "does-not-exist.yaml"])
    assert bad.exit_code == 2


def test_status_patches_apply_to_the_typed_status_as_to_the_resource() -> None:
    """The local runner's status takes the same merge patches the operator writes: a step's metrics replace the
    last step's (None removes), other metrics (evaluations) stay, nested keys merge."""
    from agentgym.lifecycle import apply_status_patch, merge_patch
    from agentgym.spec import TrainingRunStatus

    status = TrainingRunStatus(metrics={"eval/start/success": 0.1, "reward_mean": 0.2})
    state = rl_pb2.CurriculumState(step=3, stage=1, horizon=5)
    state.metrics["success_rate"] = 0.5
    status = apply_status_patch(status, curriculum_status(state, {"reward_mean": 0.2}))
    assert (status.step, status.stage, status.horizon, status.reward) == (3, 1, 5, 0.5)
    assert status.metrics == {"eval/start/success": 0.1, "success_rate": 0.5}
    assert merge_patch({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": None, "e": {"f": None}}, "d": [1]}) == {
        "a": {"c": 2, "e": {}},
        "d": [1],
    }
