"""Reconciling one TrainingRun: streams, children, weights on inference, status.

`reconcile` is idempotent: it builds the desired children (`manifests.build_children`), creates the
missing ones, merge-patches the others, deletes what must not exist in the current state (HPAs while
idle), brings inference replicas to the latest policy version, and writes phase/conditions. The kopf
handlers (`handlers.py`) call it on create/update/resume, on a resync timer (drift: a deleted child is
recreated, a scaled one is restored), and after each WeightUpdate.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from nats.errors import Error as NatsError
from nats.js.errors import Error as JetStreamError

from agentgym.lifecycle import JobState, Observed, Replicas, compute_status, same_conditions
from agentgym.messaging import RunChannels, delete_run_streams, ensure_run_streams
from agentgym.operator import kube, manifests
from agentgym.operator.config import OperatorConfig, with_credentials
from agentgym.operator.kube import KubeClient, KubeError
from agentgym.operator.manifests import Checkpoint, RunInputs, child_name
from agentgym.operator.natsbus import NatsPool, NatsUnavailable
from agentgym.operator.weights import WeightRoller, ready_replicas, roller_for, sync_replicas
from agentgym.spec import SpecError, TrainingRun, parse_training_run

JSONDict = dict[str, Any]
EventSink = Callable[[str, str, str], None]  # (type, reason, message)


class InvalidSpec(Exception):
    """The run's spec fails the model's validation: permanent until the spec changes."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("invalid spec: " + "; ".join(errors))


class Retry(Exception):
    """A temporary problem (reason, message): the reconcile is retried with backoff."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


class Rejected(Exception):
    """The API server refused a child for good (e.g. 422): permanent until the spec or config changes."""


@dataclass
class Platform:
    """What every handler shares: config and clients."""

    config: OperatorConfig
    kube: KubeClient
    nats: NatsPool
    http: aiohttp.ClientSession
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def lock(self, uid: str) -> asyncio.Lock:
        return self.locks.setdefault(uid, asyncio.Lock())

    def roller(self, engine: str) -> WeightRoller:
        return roller_for(engine, self.http, self.config.inference.load_timeout_seconds)

    async def close(self) -> None:
        await self.nats.close()
        await self.kube.close()
        await self.http.close()


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_run(body: Mapping[str, Any]) -> TrainingRun:
    document = {
        "apiVersion": body.get("apiVersion", "agentgym.io/v1alpha1"),
        "kind": body.get("kind", "TrainingRun"),
        "metadata": {k: v for k, v in body.get("metadata", {}).items() if k in ("name", "namespace", "labels")},
        "spec": body.get("spec"),
    }
    try:
        return parse_training_run(document)
    except SpecError as error:
        raise InvalidSpec(error.errors) from None


async def resolve_nats_url(platform: Platform, run: TrainingRun, namespace: str) -> str:
    """The run's NATS URL with credentials: the spec's server and Secret, else the platform's."""
    messaging = run.spec.messaging
    if messaging.credentials_secret is None:
        return messaging.nats_url or platform.config.platform_nats_url()
    base = messaging.nats_url or platform.config.nats.url
    secret = await platform.kube.get(kube.SECRET, namespace, messaging.credentials_secret)
    if secret is None:
        raise Retry("CredentialsMissing", f"Secret {messaging.credentials_secret!r} (spec.messaging) not found")
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    if data.get("token"):
        return with_credentials(base, token=data["token"])
    if data.get("user") and data.get("password"):
        return with_credentials(base, user=data["user"], password=data["password"])
    raise Retry("CredentialsInvalid", f"Secret {messaging.credentials_secret!r} needs keys user+password, or token")


async def ensure_streams(platform: Platform, url: str, run: str) -> None:
    try:
        js = await platform.nats.jetstream(url)
        await ensure_run_streams(js, RunChannels(run))
    except NatsUnavailable as error:
        raise Retry("NatsUnavailable", str(error)) from None
    except (NatsError, JetStreamError, TimeoutError) as error:
        raise Retry("NatsUnavailable", f"cannot create the run's streams: {error or type(error).__name__}") from None


async def delete_streams(platform: Platform, url: str, run: str) -> list[str]:
    try:
        js = await platform.nats.jetstream(url)
        return await delete_run_streams(js, RunChannels(run))
    except NatsUnavailable as error:
        raise Retry("NatsUnavailable", str(error)) from None
    except (NatsError, JetStreamError, TimeoutError) as error:
        raise Retry("NatsUnavailable", f"cannot delete the run's streams: {error or type(error).__name__}") from None


# ---------------------------------------------------------------------------------------------------------------------
# applying children
# ---------------------------------------------------------------------------------------------------------------------


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences", []))


def child_patch(desired: Mapping[str, Any], live: Mapping[str, Any]) -> JSONDict | None:
    """The merge patch that brings `live` to `desired`, None when nothing needs to change.

    Jobs: only `spec.suspend` (their pod template is immutable). Environment Deployments: `spec.replicas`
    belongs to the HPA, except when scaling to zero or back up from zero.
    """
    metadata = {
        k: desired["metadata"][k] for k in ("labels", "annotations", "ownerReferences") if k in desired["metadata"]
    }
    if desired["kind"] == "Job":
        patch: JSONDict = {"metadata": metadata}
        finished = JobState.of(live)
        if finished is None or not finished.finished:
            patch["spec"] = {"suspend": desired["spec"]["suspend"]}
    else:
        patch = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "status")}
        patch["metadata"] = metadata
        if desired["kind"] == "Deployment" and desired["metadata"]["labels"].get(manifests.COMPONENT_LABEL) == "env":
            wanted, current = desired["spec"]["replicas"], live.get("spec", {}).get("replicas", 1)
            if wanted != 0 and current != 0:
                patch["spec"] = {k: v for k, v in patch["spec"].items() if k != "replicas"}
    return None if _contains(live, patch) else patch


def _contains(live: Any, patch: Any) -> bool:
    if isinstance(patch, Mapping):
        return isinstance(live, Mapping) and all(k in live and _contains(live[k], v) for k, v in patch.items())
    return bool(live == patch)


async def apply_child(client: KubeClient, desired: JSONDict, owner_uid: str) -> tuple[JSONDict, bool]:
    """Create or patch one child; returns (the live object, whether it was created)."""
    kind = kube.Kind.of(desired)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    live = await client.get(kind, namespace, name)
    if live is None:
        try:
            return await client.create(desired), True
        except kube.Conflict:  # created meanwhile (another handler of the same run)
            live = await client.get(kind, namespace, name)
            if live is None:
                raise
    if not _owned_by(live, owner_uid):
        raise Rejected(f"{desired['kind']} {name!r} exists and is not owned by this run; rename or remove it")
    patch = child_patch(desired, live)
    if patch is None:
        return live, False
    return await client.patch(kind, namespace, name, patch), False


def _template_checkpoint(deployment: Mapping[str, Any] | None) -> Checkpoint | None:
    if deployment is None:
        return None
    annotations = deployment.get("metadata", {}).get("annotations", {})
    version, uri = (
        annotations.get(manifests.POLICY_VERSION_ANNOTATION),
        annotations.get(manifests.CHECKPOINT_ANNOTATION),
    )
    if version is None or not uri or not str(version).isdigit():
        return None
    return Checkpoint(int(version), uri)


# ---------------------------------------------------------------------------------------------------------------------
# the reconcile
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    phase: str
    created: list[str] = field(default_factory=list)
    served_policy_version: int | None = None


async def write_status(client: KubeClient, body: Mapping[str, Any], patch: JSONDict) -> None:
    meta = body["metadata"]
    with contextlib.suppress(kube.NotFound):  # deleted meanwhile
        await client.patch(kube.TRAINING_RUN, meta["namespace"], meta["name"], {"status": patch}, subresource="status")


async def reconcile(
    platform: Platform, body: Mapping[str, Any], *, emit: EventSink, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> Outcome:
    """Bring the run's children, streams, inference weights and status to the spec. Raises InvalidSpec,
    Retry (temporary), Rejected (permanent) or KubeError after writing what it could into the status."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    generation = int(meta.get("generation", 1))
    status: Mapping[str, Any] = body.get("status") or {}
    previous = status.get("conditions", [])
    client = platform.kube

    try:
        run = parse_run(body)
    except InvalidSpec as error:
        patch = compute_status(
            Observed(), generation=generation, previous=previous, now=now(), invalid_spec=error.errors
        )
        if status.get("phase") != "Failed" or not same_conditions(
            _strip_times(previous), _strip_times(patch["conditions"])
        ):
            await write_status(client, body, patch)
            emit("Warning", "InvalidSpec", error.args[0])
        raise

    problem: Retry | None = None
    nats_url = ""
    try:
        nats_url = await resolve_nats_url(platform, run, namespace)
        await ensure_streams(platform, nats_url, name)
    except Retry as error:
        problem = error

    job_live = await client.get(kube.JOB, namespace, child_name(name, "trainer"))
    job_state = JobState.of(job_live)
    finished = bool(job_state and job_state.finished)
    idle = run.spec.suspend or finished
    inference_live = await client.get(kube.DEPLOYMENT, namespace, child_name(name, "inference"))
    checkpoint = _template_checkpoint(inference_live)
    latest = None
    if int(status.get("policyVersion") or 0) > 0 and status.get("lastCheckpoint"):
        latest = Checkpoint(int(status["policyVersion"]), str(status["lastCheckpoint"]))
    served: int | None = None  # what the replicas serve, when asked in this reconcile
    if latest is not None and inference_live is None:
        checkpoint = latest  # (re)created inference starts on the newest weights, not the base model
    if latest is not None and inference_live is not None and not idle:
        pods = await client.list(kube.POD, namespace, manifests.selector(name, "inference"))
        result = await sync_replicas(platform.roller(run.spec.inference.engine), ready_replicas(pods), latest)
        if result.reloaded:
            emit("Normal", "WeightsLoaded", f"v{latest.version} loaded by {', '.join(result.reloaded)}")
        if result.failed and (checkpoint is None or checkpoint.version < latest.version):
            reasons = "; ".join(f"{pod}: {why}" for pod, why in sorted(result.failed.items()))
            emit(
                "Warning",
                "WeightReloadFailed",
                f"restarting inference onto {latest.uri} (v{latest.version}): {reasons}",
            )
            logger.warning(f"weight reload of v{latest.version} failed, restarting inference: {reasons}")
            checkpoint = latest
        if result.served is not None:
            served = result.served

    inputs = RunInputs(
        run=run,
        namespace=namespace,
        config=platform.config,
        nats_url=nats_url or platform.config.platform_nats_url(),
        inference_checkpoint=checkpoint,
        finished=finished,
    )
    children = manifests.build_children(inputs)
    if not nats_url:  # unresolved (e.g. its credentials Secret is missing): leave the run's NATS Secret alone
        children = [c for c in children if c["kind"] != "Secret"]
    kopf.adopt(children, owner=dict(body))  # type: ignore[arg-type]
    outcome = Outcome(phase="Pending", served_policy_version=served)

    for api_version, kind_name, absent in manifests.absent_children(inputs):
        kind = kube.Kind(api_version, kind_name)
        live = await client.get(kind, namespace, absent)
        if live is not None and _owned_by(live, uid):
            await client.delete(kind, namespace, absent)

    applied: dict[tuple[str, str], JSONDict] = {}
    try:
        # The claim comes before the children: the trainer Job's pod mounts it, and waits unschedulable without it.
        claim = manifests.checkpoint_claim(inputs)
        if claim is not None and await client.get(kube.PVC, namespace, claim["metadata"]["name"]) is None:
            if not run.spec.storage.volume_claim:
                kopf.adopt(claim, owner=dict(body))  # type: ignore[arg-type]
            try:
                await client.create(claim)
                emit("Normal", "CheckpointVolumeCreated", f"PersistentVolumeClaim {claim['metadata']['name']}")
            except kube.Conflict:
                pass
        for child in children:
            live, created = await apply_child(client, child, uid)
            applied[(child["kind"], child["metadata"]["name"])] = live
            if created:
                outcome.created.append(f"{child['kind']}/{child['metadata']['name']}")
    except KubeError as error:
        if error.temporary:
            raise
        message = f"the API server rejected a child: {error}"
        await write_status(client, body, _rejected_status(previous, generation, message))
        raise Rejected(message) from None
    except Rejected as error:
        await write_status(client, body, _rejected_status(previous, generation, str(error)))
        raise
    if outcome.created:
        emit("Normal", "Reconciled", f"created {', '.join(outcome.created)}")

    environments: dict[str, Replicas | None] = {
        env.name: Replicas.of(applied.get(("Deployment", manifests.env_name(name, env.name))))
        for env in run.spec.environments
        if env.url is None
    }
    observed = Observed(
        environments=environments,
        inference=Replicas.of(applied.get(("Deployment", child_name(name, "inference")))),
        job=JobState.of(applied.get(("Job", child_name(name, "trainer")))),
        policy_version=int(status.get("policyVersion") or 0),
        served_policy_version=served if served is not None else status.get("servedPolicyVersion"),
        max_staleness=run.spec.rollout.max_staleness,
        suspended=run.spec.suspend,
        problem=(problem.reason, problem.message) if problem else None,
    )
    patch = compute_status(observed, generation=generation, previous=previous, now=now())
    if served is not None:
        patch["servedPolicyVersion"] = served
    if not status.get("startTime"):
        patch["startTime"] = now()
    if observed.job is not None and observed.job.finished and not status.get("completionTime"):
        patch["completionTime"] = now()
    if patch["phase"] != status.get("phase"):
        emit("Normal", patch["phase"], f"phase {status.get('phase', 'none')} -> {patch['phase']}")
    if _status_changed(status, patch):
        await write_status(client, body, patch)
    outcome.phase = patch["phase"]
    if problem is not None:
        raise problem
    return outcome


def _rejected_status(previous: Any, generation: int, message: str) -> JSONDict:
    patch = compute_status(
        Observed(problem=("ChildRejected", message)), generation=generation, previous=previous, now=now()
    )
    return {"conditions": patch["conditions"], "observedGeneration": generation}


def _strip_times(conditions: Any) -> list[JSONDict]:
    return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conditions]


def _status_changed(status: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    for key, value in patch.items():
        if key == "conditions":
            if not same_conditions(status.get("conditions", []), value):
                return True
        elif status.get(key) != value:
            return True
    return False


async def run_streams_url(platform: Platform, body: Mapping[str, Any]) -> tuple[TrainingRun, str]:
    run = parse_run(body)
    return run, await resolve_nats_url(platform, run, body["metadata"]["namespace"])
