"""The operator end to end: kopf + our handlers against the fidelity kmock API server and a real nats-server.

Nothing is mocked inside the operator: it logs in with a kubeconfig, watches TrainingRuns, writes children
and status through HTTP, talks to NATS JetStream, and calls the inference replicas' weight API over HTTP
(local fake engines). The tests play the other controllers' part where the platform depends on them
(Deployment/Job status, pods of the inference Deployment).
"""

from __future__ import annotations

import asyncio
import copy
import signal
import sys
from typing import Any

import aiohttp
import nats
import pytest
import yaml
from kube_emulator import FidelityKubernetesEmulator
from nats.js.errors import NotFoundError
from operator_harness import (
    NAMESPACE,
    OPERATOR_NAMESPACE,
    ApiError,
    Cluster,
    FakeEngine,
    OperatorHandle,
    load_example,
    operator_config,
    running_operator,
    secret_value,
)

from agentgym.messaging import EmbeddedNats, RunChannels, free_port, publish_message
from agentgym.proto import rl_pb2

RUN = "babyai-rl"
CONDITION_TYPES = {"Ready", "EnvironmentsReady", "InferenceReady", "TrainerRunning", "Complete", "Failed", "Suspended"}


def training_run(name: str = RUN, **spec_changes: Any) -> dict[str, Any]:
    """The quickstart run plus an external TextCraft service and a 1..3 replica range for BabyAI."""
    document = load_example("quickstart.yaml")
    document["metadata"] = {"name": name, "labels": {"team": "rl"}}
    spec = document["spec"]
    spec["environments"][0]["replicas"] = {"min": 1, "max": 3}
    spec["environments"].append({"name": "textcraft", "url": "http://textcraft.shared.svc:8000"})
    spec["rollout"]["maxStaleness"] = 0  # on-policy: inference one version behind is WeightsStale
    spec.update(copy.deepcopy(spec_changes))
    return document


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def owner_uids(obj: dict[str, Any]) -> list[str]:
    return [ref["uid"] for ref in obj["metadata"].get("ownerReferences", []) if ref.get("controller")]


CHILDREN = [
    ("ConfigMap", f"{RUN}-spec"),
    ("Secret", f"{RUN}-nats"),
    ("NetworkPolicy", f"{RUN}-envs"),
    ("NetworkPolicy", f"{RUN}-inference"),
    ("NetworkPolicy", f"{RUN}-workers"),
    ("Deployment", f"{RUN}-env-babyai"),
    ("Service", f"{RUN}-env-babyai"),
    ("HorizontalPodAutoscaler", f"{RUN}-env-babyai"),
    ("Deployment", f"{RUN}-inference"),
    ("Service", f"{RUN}-inference"),
    ("Deployment", f"{RUN}-rollout"),
    ("Job", f"{RUN}-trainer"),
]


async def create_and_wait(cluster: Cluster, document: dict[str, Any]) -> dict[str, Any]:
    created = await cluster.create("TrainingRun", document)
    name = created["metadata"]["name"]

    async def all_children() -> bool:
        for kind, child in CHILDREN:
            if await cluster.get(kind, child.replace(RUN, name)) is None:
                return False
        return bool((await cluster.status_of(name)).get("conditions"))

    await cluster.wait_for(all_children, what="every child and a status")
    return created


async def mark_ready(cluster: Cluster, run: str = RUN, *, trainer_active: bool = True) -> None:
    """Play the Deployment/Job controllers: every replica ready, the trainer pod running."""
    for deployment in (f"{run}-env-babyai", f"{run}-inference", f"{run}-rollout"):
        live = await cluster.get("Deployment", deployment)
        assert live is not None
        replicas = live["spec"]["replicas"]
        status = {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}
        await cluster.patch("Deployment", deployment, {"status": status}, subresource="status")
    if trainer_active:
        await cluster.patch("Job", f"{run}-trainer", {"status": {"active": 1}}, subresource="status")


async def add_inference_pod(cluster: Cluster, name: str, engine: FakeEngine, *, annotations: dict[str, str]) -> None:
    """Play the ReplicaSet controller and kubelet: a ready inference pod whose IP:port is a fake engine."""
    deployment = await cluster.get("Deployment", f"{RUN}-inference")
    assert deployment is not None
    template = deployment["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": template["metadata"]["labels"], "annotations": annotations},
        "spec": copy.deepcopy(template["spec"]),
    }
    pod["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}]
    await cluster.create("Pod", pod)
    status = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
    await cluster.patch("Pod", name, {"status": status}, subresource="status")


# ---------------------------------------------------------------------------------------------------------------------


async def test_create_builds_owned_children_streams_and_status(
    cluster: Cluster, operator: OperatorHandle, nats_server: EmbeddedNats
) -> None:
    created = await create_and_wait(cluster, training_run())
    uid = created["metadata"]["uid"]

    for kind, name in CHILDREN:
        child = await cluster.get(kind, name)
        assert child is not None, f"{kind}/{name} missing"
        refs = child["metadata"]["ownerReferences"]
        assert refs == [
            {
                "apiVersion": "agentgym.io/v1alpha1",
                "kind": "TrainingRun",
                "name": RUN,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], f"{kind}/{name}"
        assert child["metadata"]["labels"]["agentgym.io/run"] == RUN
        assert child["metadata"]["labels"]["team"] == "rl"  # adopted: the owner's labels
    assert await cluster.get("Deployment", f"{RUN}-env-textcraft") is None  # external: not ours to run

    env = await cluster.get("Deployment", f"{RUN}-env-babyai")
    assert env is not None
    assert env["spec"]["replicas"] == 1
    container = env["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "agentgym/env-babyai:0.1.0"
    assert container["command"][:4] == ["agentgym", "env", "serve", "babyai"]
    assert container["command"][container["command"].index("--max-episodes") + 1] == "128"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert env["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    hpa = await cluster.get("HorizontalPodAutoscaler", f"{RUN}-env-babyai")
    assert hpa is not None
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RUN}-env-babyai"

    inference = await cluster.get("Deployment", f"{RUN}-inference")
    assert inference is not None
    container = inference["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "agentgym/inference-cpu:0.1.0"
    assert container["command"][:5] == ["agentgym", "inference", "serve", "--model", "builtin:tiny"]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})

    rollout = await cluster.get("Deployment", f"{RUN}-rollout")
    assert rollout is not None
    command = rollout["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:5] == ["agentgym", "rollout", "worker", "--spec", "/etc/agentgym/spec.yaml"]  # the mounted spec
    assert f"babyai=http://{RUN}-env-babyai.{NAMESPACE}.svc:8000" in command
    assert "textcraft=http://textcraft.shared.svc:8000" in command
    assert command[command.index("--inference-url") + 1] == f"http://{RUN}-inference.{NAMESPACE}.svc:8000"
    env_vars = {e["name"]: e for e in rollout["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env_vars["AGENTGYM_NATS_URL"]["valueFrom"]["secretKeyRef"] == {"name": f"{RUN}-nats", "key": "url"}
    assert env_vars["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector.agentgym-system.svc:4318"

    job = await cluster.get("Job", f"{RUN}-trainer")
    assert job is not None
    assert job["spec"]["suspend"] is False
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"][:3] == ["python", "-m", "agentgym.trainer.entrypoint"]
    assert trainer["command"][trainer["command"].index("--run") + 1] == "/etc/agentgym/spec.yaml"
    assert trainer["command"][trainer["command"].index("--run-name") + 1] == RUN

    secret = await cluster.get("Secret", f"{RUN}-nats")
    assert secret is not None and secret_value(secret, "url") == nats_server.url
    spec_map = await cluster.get("ConfigMap", f"{RUN}-spec")
    assert spec_map is not None and "groupSize: 8" in spec_map["data"]["spec.yaml"]
    policy = await cluster.get("NetworkPolicy", f"{RUN}-inference")
    assert policy is not None
    peers = policy["spec"]["ingress"][0]["from"]
    assert peers[1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}

    client = await nats.connect(nats_server.url)
    try:
        js = client.jetstream()
        channels = RunChannels(RUN)
        for stream in (channels.requests_stream, channels.trajectories_stream, channels.control_stream):
            assert (await js.stream_info(stream)).config.name == stream
    finally:
        await client.close()

    status = await cluster.status_of(RUN)
    assert status["phase"] == "Pending"
    assert status["observedGeneration"] == 1
    assert {c["type"] for c in status["conditions"]} == CONDITION_TYPES
    assert all(c["observedGeneration"] == 1 and c["reason"] and c["lastTransitionTime"] for c in status["conditions"])
    assert condition(status, "Suspended")["status"] == "False"
    assert condition(status, "Ready")["status"] == "False"
    assert status["startTime"]

    await mark_ready(cluster)
    status = await cluster.wait_for(
        lambda: _status_if(
            cluster, lambda s: s.get("phase") == "Running" and condition(s, "Ready").get("status") == "True"
        ),
        what="Running and Ready",
    )
    assert condition(status, "EnvironmentsReady")["reason"] == "AllReady"
    assert condition(status, "InferenceReady")["reason"] == "Serving"
    events = await cluster.events_for(RUN)
    assert any(e["reason"] == "Reconciled" for e in events)


async def _status_if(cluster: Cluster, predicate: Any, run: str = RUN) -> dict[str, Any] | None:
    status = await cluster.status_of(run)
    return status if predicate(status) else None


async def test_update_then_suspend_and_resume(cluster: Cluster, operator: OperatorHandle) -> None:
    await create_and_wait(cluster, training_run())
    await cluster.patch("TrainingRun", RUN, {"spec": {"rollout": {"workers": 3}, "inference": {"replicas": 2}}})

    async def scaled() -> bool:
        rollout = await cluster.get("Deployment", f"{RUN}-rollout")
        inference = await cluster.get("Deployment", f"{RUN}-inference")
        return bool(rollout and inference and rollout["spec"]["replicas"] == 3 and inference["spec"]["replicas"] == 2)

    await cluster.wait_for(scaled, what="rollout=3, inference=2")
    run = await cluster.get("TrainingRun", RUN)
    assert run is not None and run["metadata"]["generation"] == 2
    status = await cluster.wait_for(
        lambda: _status_if(cluster, lambda s: s.get("observedGeneration") == 2), what="observedGeneration 2"
    )
    assert all(c["observedGeneration"] == 2 for c in status["conditions"])

    # What cannot change mid-run is refused by the CRD's CEL rules, naming the field.
    with pytest.raises(ApiError) as refused:
        await cluster.patch("TrainingRun", RUN, {"spec": {"algorithm": {"learningRate": 0.5}}})
    assert refused.value.status == 422 and "spec.algorithm cannot change during a run" in refused.value.body["message"]

    await cluster.patch("TrainingRun", RUN, {"spec": {"suspend": True}})

    async def suspended() -> bool:
        replicas = [
            (await cluster.get("Deployment", f"{RUN}-{d}") or {}).get("spec", {}).get("replicas") for d in DEPLOYS
        ]
        job = await cluster.get("Job", f"{RUN}-trainer")
        hpa = await cluster.get("HorizontalPodAutoscaler", f"{RUN}-env-babyai")
        return replicas == [0, 0, 0] and bool(job and job["spec"]["suspend"]) and hpa is None

    await cluster.wait_for(suspended, what="everything scaled to zero, HPA removed, Job suspended")
    status = await cluster.wait_for(
        lambda: _status_if(cluster, lambda s: s.get("phase") == "Suspended"), what="phase Suspended"
    )
    assert condition(status, "Suspended")["status"] == "True"
    assert condition(status, "Ready")["reason"] == "Suspended"

    await cluster.patch("TrainingRun", RUN, {"spec": {"suspend": False}})

    async def resumed() -> bool:
        replicas = [
            (await cluster.get("Deployment", f"{RUN}-{d}") or {}).get("spec", {}).get("replicas") for d in DEPLOYS
        ]
        job = await cluster.get("Job", f"{RUN}-trainer")
        hpa = await cluster.get("HorizontalPodAutoscaler", f"{RUN}-env-babyai")
        return replicas == [1, 2, 3] and bool(job and job["spec"]["suspend"] is False) and hpa is not None

    await cluster.wait_for(resumed, what="replicas restored, HPA back, Job resumed")
    status = await cluster.wait_for(
        lambda: _status_if(cluster, lambda s: condition(s, "Suspended").get("status") == "False"), what="resumed"
    )
    assert status["phase"] == "Pending"


DEPLOYS = ("env-babyai", "inference", "rollout")


async def test_deleted_children_are_recreated(cluster: Cluster, operator: OperatorHandle) -> None:
    created = await create_and_wait(cluster, training_run())
    victims = [("Deployment", f"{RUN}-env-babyai"), ("Service", f"{RUN}-env-babyai"), ("ConfigMap", f"{RUN}-spec")]
    victims += [("Job", f"{RUN}-trainer"), ("HorizontalPodAutoscaler", f"{RUN}-env-babyai")]
    before = {v: (await cluster.get(*v) or {})["metadata"]["uid"] for v in victims}
    for kind, name in victims:
        await cluster.delete(kind, name)

    async def recreated() -> bool:
        for victim in victims:
            live = await cluster.get(*victim)
            if live is None or live["metadata"]["uid"] == before[victim]:
                return False
            if owner_uids(live) != [created["metadata"]["uid"]]:
                return False
        return True

    await cluster.wait_for(recreated, what="the deleted children back, owned by the run")

    # Drift in a field is put back too (a hand-scaled rollout Deployment).
    await cluster.patch("Deployment", f"{RUN}-rollout", {"spec": {"replicas": 7}})
    await cluster.wait_for(
        lambda: _replicas_are(cluster, f"{RUN}-rollout", 1), what="the rollout Deployment back at spec.rollout.workers"
    )


async def _replicas_are(cluster: Cluster, name: str, replicas: int) -> bool:
    live = await cluster.get("Deployment", name)
    return bool(live and live["spec"]["replicas"] == replicas)


async def test_nats_control_messages_feed_status_and_roll_weights(
    cluster: Cluster, operator: OperatorHandle, nats_server: EmbeddedNats, engines: list[FakeEngine]
) -> None:
    await create_and_wait(cluster, training_run())
    await mark_ready(cluster)
    for index, engine in enumerate(engines):
        await add_inference_pod(cluster, f"{RUN}-inference-{index}", engine, annotations={})
    channels = RunChannels(RUN)
    client = await nats.connect(nats_server.url)
    js = client.jetstream()
    try:
        state = rl_pb2.CurriculumState(run=RUN, step=12, stage=1, horizon=8, schedule="scaling_inter")
        state.metrics.update({"reward_mean": 0.42, "success_rate": 0.5})
        await publish_message(js, channels.curriculum_subject, state)
        checkpoint_v3 = "file:///var/lib/agentgym/runs/quickstart/v3"
        await publish_message(js, channels.weights_subject, rl_pb2.WeightUpdate(run=RUN, version=3, uri=checkpoint_v3))

        status = await cluster.wait_for(
            lambda: _status_if(cluster, lambda s: s.get("servedPolicyVersion") == 3 and s.get("step") == 12),
            what="step 12 and v3 served",
        )
        assert (status["stage"], status["horizon"], status["reward"]) == (1, 8, 0.42)
        assert status["metrics"] == {"reward_mean": 0.42, "success_rate": 0.5}
        assert (status["policyVersion"], status["lastCheckpoint"]) == (3, checkpoint_v3)
        for engine in engines:
            assert engine.loads == [{"uri": checkpoint_v3, "version": 3}]
        status = await cluster.wait_for(
            lambda: _status_if(cluster, lambda s: condition(s, "InferenceReady").get("status") == "True"),
            what="InferenceReady after the reload",
        )
        assert "v3" in condition(status, "InferenceReady")["message"]

        # A later step replaces the metrics (a metric that disappeared is removed).
        state = rl_pb2.CurriculumState(run=RUN, step=20, stage=2, horizon=12, schedule="scaling_inter")
        state.metrics.update({"reward_mean": 0.61})
        await publish_message(js, channels.curriculum_subject, state)
        status = await cluster.wait_for(
            lambda: _status_if(cluster, lambda s: s.get("step") == 20), what="step 20 in the status"
        )
        assert status["metrics"] == {"reward_mean": 0.61} and status["horizon"] == 12

        # A replica that cannot load the next version: inference is restarted onto the checkpoint.
        engines[1].fail_loads = True
        checkpoint_v4 = "file:///var/lib/agentgym/runs/quickstart/v4"
        await publish_message(js, channels.weights_subject, rl_pb2.WeightUpdate(run=RUN, version=4, uri=checkpoint_v4))

        async def restarted() -> dict[str, Any] | None:
            live = await cluster.get("Deployment", f"{RUN}-inference")
            template = (live or {}).get("spec", {}).get("template", {})
            if template.get("metadata", {}).get("annotations", {}).get("agentgym.io/policy-version") != "4":
                return None
            return live

        deployment = await cluster.wait_for(restarted, what="the inference template moved onto v4")
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[command.index("--model") + 1] == "/var/lib/agentgym/runs/quickstart/v4"
        status = await cluster.wait_for(
            lambda: _status_if(cluster, lambda s: condition(s, "InferenceReady").get("reason") == "WeightsStale"),
            what="InferenceReady=False WeightsStale",
        )
        assert status["policyVersion"] == 4 and status["servedPolicyVersion"] == 3
        assert "serving v3, latest v4" in condition(status, "InferenceReady")["message"]
        assert any(e["reason"] == "WeightReloadFailed" for e in await cluster.events_for(RUN))

        # The Deployment controller replaces the pods; the new ones start on v4.
        for index in range(2):
            await cluster.delete("Pod", f"{RUN}-inference-{index}")
        for index, engine in enumerate(engines):
            await add_inference_pod(
                cluster, f"{RUN}-inference-new-{index}", engine, annotations={"agentgym.io/policy-version": "4"}
            )
        status = await cluster.wait_for(
            lambda: _status_if(cluster, lambda s: s.get("servedPolicyVersion") == 4), what="v4 served after restart"
        )
    finally:
        await client.close()


async def test_invalid_spec_fails_the_run_with_reasons(cluster: Cluster, operator: OperatorHandle) -> None:
    # Valid for the CRD schema, invalid for the model: vLLM needs a GPU per tensor-parallel rank.
    document = training_run(inference={"engine": "vllm", "tensorParallel": 2, "gpusPerReplica": 1})
    await cluster.create("TrainingRun", document)
    status = await cluster.wait_for(
        lambda: _status_if(cluster, lambda s: s.get("phase") == "Failed"), what="phase Failed"
    )
    failed = condition(status, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec"
    assert "gpusPerReplica (1) must be >= tensorParallel (2)" in failed["message"]
    events = await cluster.wait_for(lambda: _events_with(cluster, "InvalidSpec"), what="an InvalidSpec event")
    assert events[0]["type"] == "Warning"
    assert await cluster.get("Deployment", f"{RUN}-inference") is None


async def _events_with(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    return [e for e in await cluster.events_for(RUN) if e["reason"] == reason]


async def test_nats_outage_is_retried_until_it_recovers(cluster: Cluster, kubeconfig: Any, tmp_path: Any) -> None:
    port = free_port()
    config = operator_config(f"nats://127.0.0.1:{port}")
    async with running_operator(config):
        await cluster.create("TrainingRun", training_run())
        status = await cluster.wait_for(
            lambda: _status_if(cluster, lambda s: condition(s, "Ready").get("reason") == "NatsUnavailable"),
            what="Ready=False NatsUnavailable",
        )
        assert "cannot connect to NATS" in condition(status, "Ready")["message"]
        with EmbeddedNats(tmp_path / "late-nats", port=port) as late:
            await cluster.wait_for(
                lambda: _status_if(cluster, lambda s: condition(s, "Ready").get("reason") != "NatsUnavailable"),
                what="the outage to clear",
            )
            client = await nats.connect(late.url)
            try:
                info = await client.jetstream().stream_info(RunChannels(RUN).control_stream)
                assert info.config.name == RunChannels(RUN).control_stream
            finally:
                await client.close()


async def test_finished_trainer_completes_and_idles_the_run(cluster: Cluster, operator: OperatorHandle) -> None:
    await create_and_wait(cluster, training_run())
    await mark_ready(cluster)
    complete = {"succeeded": 1, "active": 0, "conditions": [{"type": "Complete", "status": "True"}]}
    await cluster.patch("Job", f"{RUN}-trainer", {"status": complete}, subresource="status")
    status = await cluster.wait_for(
        lambda: _status_if(cluster, lambda s: s.get("phase") == "Succeeded"), what="phase Succeeded"
    )
    assert condition(status, "Complete")["status"] == "True" and status["completionTime"]
    await cluster.wait_for(lambda: _replicas_are(cluster, f"{RUN}-inference", 0), what="inference scaled to zero")
    assert await cluster.get("HorizontalPodAutoscaler", f"{RUN}-env-babyai") is None


async def test_delete_cleans_streams_and_children(
    cluster: Cluster, api: FidelityKubernetesEmulator, operator: OperatorHandle, nats_server: EmbeddedNats
) -> None:
    await create_and_wait(cluster, training_run())
    run = await cluster.get("TrainingRun", RUN)
    assert run is not None and run["metadata"]["finalizers"] == ["agentgym.io/cleanup"]
    await cluster.delete("TrainingRun", RUN)
    await cluster.wait_for(lambda: _gone(cluster, "TrainingRun", RUN), what="the run gone (finalizer released)")
    for kind, name in CHILDREN:
        assert await cluster.get(kind, name) is None, f"{kind}/{name} not garbage-collected"
    client = await nats.connect(nats_server.url)
    try:
        for stream in (RunChannels(RUN).requests_stream, RunChannels(RUN).control_stream):
            with pytest.raises(NotFoundError):
                await client.jetstream().stream_info(stream)
    finally:
        await client.close()


async def _gone(cluster: Cluster, kind: str, name: str) -> bool:
    return await cluster.get(kind, name) is None


async def test_the_cli_runs_the_operator_from_its_config_file(
    cluster: Cluster, kubeconfig: Any, nats_server: EmbeddedNats, tmp_path: Any
) -> None:
    """`agentgym operator run` as the chart's Deployment starts it: config file, namespace, liveness endpoint."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"nats": {"url": nats_server.url}, "resyncSeconds": 1, "networkPolicies": False}))
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentgym.cli", "operator", "run", "--config", str(config),
        "--namespace", NAMESPACE, "--liveness", f"http://127.0.0.1:{port}/healthz",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await cluster.create("TrainingRun", training_run())
        await cluster.wait_for(lambda: cluster.get("Job", f"{RUN}-trainer"), what="the trainer Job", timeout=60)
        assert await cluster.get("NetworkPolicy", f"{RUN}-envs") is None  # the config file was read
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as health:
            assert health.status == 200
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
        except TimeoutError:
            process.kill()
            raise
    assert process.returncode == 0, stderr.decode()[-3000:]


async def test_gpu_run_gets_vllm_deepspeed_and_keeps_its_checkpoint_claim(
    cluster: Cluster, operator: OperatorHandle
) -> None:
    created = await cluster.create("TrainingRun", load_example("babyai-paper.yaml"))
    name = created["metadata"]["name"]
    job = await cluster.wait_for(lambda: cluster.get("Job", f"{name}-trainer"), what="the trainer Job")
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"][3:6] == ["deepspeed", "--num_gpus", "8"]  # under agentgym.trainer.launch
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"
    inference = await cluster.get("Deployment", f"{name}-inference")
    assert inference is not None and inference["spec"]["replicas"] == 2
    server = inference["spec"]["template"]["spec"]["containers"][0]
    assert server["image"] == "agentgym/inference-vllm:0.1.0" and server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    claim = await cluster.wait_for(
        lambda: cluster.get("PersistentVolumeClaim", "agentgym-checkpoints"), what="the checkpoint claim"
    )
    assert "ownerReferences" not in claim["metadata"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    hpa = await cluster.get("HorizontalPodAutoscaler", f"{name}-env-babyai")
    assert hpa is not None and (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)

    await cluster.delete("TrainingRun", name)
    await cluster.wait_for(lambda: _gone(cluster, "TrainingRun", name), what="the run gone")
    assert await cluster.get("Job", f"{name}-trainer") is None
    assert await cluster.get("PersistentVolumeClaim", "agentgym-checkpoints") is not None  # checkpoints outlive runs
