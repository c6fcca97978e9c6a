"""The TrainingRun lifecycle: its status from what its components and its control messages report, as pure
functions. The operator (`agentgym.operator.reconcile`, `handlers`) and the local runner
(`agentgym.local.runner`) both use them: the operator observes Deployments and Jobs, the runner its
processes, and each writes the same status.

- `compute_status(Observed)`: phase and conditions;
- `curriculum_status(CurriculumState)`: step, stage, horizon, metrics and reward;
- `weights_status(WeightUpdate)`: policy version and last checkpoint;
- `apply_status_patch(status, patch)`: a patch of these onto the typed `TrainingRunStatus`, as the API
  server's merge patch does onto the custom resource.

Conditions (each with `observedGeneration`, a CamelCase `reason` and a message):
- EnvironmentsReady: every environment service the run owns has a ready replica;
- InferenceReady: all inference replicas are ready and serve the latest policy version (or one within
  `rollout.maxStaleness` of it);
- TrainerRunning: the trainer Job has an active pod;
- Complete / Failed: the trainer Job succeeded / failed, or (Failed) the spec is invalid;
- Suspended: `spec.suspend` is true;
- Ready: environments and inference ready and the trainer running.
`lastTransitionTime` only moves when a condition's status flips.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentgym.proto import rl_pb2
from agentgym.spec import TrainingRunStatus

JSONDict = dict[str, Any]

# The step metric reported as `status.reward` (the first one present).
REWARD_METRICS = ("reward_mean", "reward", "score_mean", "success_rate")

CONDITION_TYPES = ("Ready", "EnvironmentsReady", "InferenceReady", "TrainerRunning", "Complete", "Failed", "Suspended")


@dataclass(frozen=True)
class Replicas:
    ready: int
    desired: int

    @classmethod
    def of(cls, deployment: Mapping[str, Any] | None) -> Replicas | None:
        if deployment is None:
            return None
        status = deployment.get("status", {})
        return cls(ready=int(status.get("readyReplicas", 0) or 0), desired=int(deployment["spec"].get("replicas", 1)))


@dataclass(frozen=True)
class JobState:
    active: int = 0
    succeeded: bool = False
    failed: bool = False
    reason: str = ""
    message: str = ""

    @classmethod
    def of(cls, job: Mapping[str, Any] | None) -> JobState | None:
        if job is None:
            return None
        status = job.get("status", {})
        conditions = {c.get("type"): c for c in status.get("conditions", []) if c.get("status") == "True"}
        failed = conditions.get("Failed")
        return cls(
            active=int(status.get("active", 0) or 0),
            succeeded="Complete" in conditions or int(status.get("succeeded", 0) or 0) > 0,
            failed=failed is not None,
            reason=(failed or {}).get("reason", ""),
            message=(failed or {}).get("message", ""),
        )

    @property
    def finished(self) -> bool:
        return self.succeeded or self.failed


@dataclass(frozen=True)
class Observed:
    """What the reconcile saw of the run's children and NATS state."""

    environments: Mapping[str, Replicas | None] = field(default_factory=dict)
    """Environments the run owns (external ones, with a `url`, are not listed)."""
    inference: Replicas | None = None
    job: JobState | None = None
    policy_version: int = 0
    served_policy_version: int | None = None
    max_staleness: int = 0
    suspended: bool = False
    suspended_reason: tuple[str, str] = ("SuspendedBySpec", "work scaled to zero; set spec.suspend=false to resume")
    """Why it is suspended (reason, message): the spec, or a local run stopped by its user."""
    problem: tuple[str, str] | None = None
    """A temporary problem (reason, message) the reconcile is retrying, e.g. NATS unreachable."""


def _condition(kind: str, ok: bool, reason: str, message: str = "") -> JSONDict:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def _environments(observed: Observed) -> JSONDict:
    if observed.suspended:
        return _condition("EnvironmentsReady", False, "Suspended", "the run is suspended")
    if observed.job is not None and observed.job.finished:
        return _condition("EnvironmentsReady", False, "RunFinished", "scaled to zero after the trainer finished")
    missing = sorted(name for name, r in observed.environments.items() if r is None)
    waiting = sorted(name for name, r in observed.environments.items() if r is not None and r.ready < 1)
    if missing:
        return _condition("EnvironmentsReady", False, "Creating", f"not created yet: {', '.join(missing)}")
    if waiting:
        return _condition("EnvironmentsReady", False, "Waiting", f"no ready replica yet: {', '.join(waiting)}")
    ready = ", ".join(f"{n}={r.ready}" for n, r in sorted(observed.environments.items()) if r is not None)
    return _condition("EnvironmentsReady", True, "AllReady", ready or "every environment is external")


def _inference(observed: Observed) -> JSONDict:
    if observed.suspended:
        return _condition("InferenceReady", False, "Suspended", "the run is suspended")
    if observed.job is not None and observed.job.finished:
        return _condition("InferenceReady", False, "RunFinished", "scaled to zero after the trainer finished")
    replicas = observed.inference
    if replicas is None:
        return _condition("InferenceReady", False, "Creating", "the inference Deployment does not exist yet")
    if replicas.ready < replicas.desired:
        return _condition("InferenceReady", False, "Waiting", f"{replicas.ready}/{replicas.desired} replicas ready")
    latest, served = observed.policy_version, observed.served_policy_version
    if latest > 0 and (served is None or latest - served > observed.max_staleness):
        served_text = "unknown" if served is None else f"v{served}"
        return _condition("InferenceReady", False, "WeightsStale", f"serving {served_text}, latest v{latest}")
    version = f"v{served}" if served is not None and latest > 0 else "the base model"
    return _condition("InferenceReady", True, "Serving", f"{replicas.ready} replicas serve {version}")


def _trainer(observed: Observed) -> JSONDict:
    job = observed.job
    if observed.suspended:
        return _condition("TrainerRunning", False, "Suspended", "the trainer Job is suspended")
    if job is None:
        return _condition("TrainerRunning", False, "Creating", "the trainer Job does not exist yet")
    if job.succeeded:
        return _condition("TrainerRunning", False, "Completed", "the trainer finished")
    if job.failed:
        return _condition("TrainerRunning", False, "Failed", job.message or job.reason)
    if job.active < 1:
        return _condition("TrainerRunning", False, "Pending", "the trainer pod is not running yet")
    return _condition("TrainerRunning", True, "Running", "the trainer pod is running")


def compute_status(
    observed: Observed,
    *,
    generation: int,
    previous: Sequence[Mapping[str, Any]] = (),
    now: str,
    invalid_spec: Sequence[str] = (),
) -> JSONDict:
    """Phase, conditions and observedGeneration (the part of the status the reconcile owns)."""
    if invalid_spec:
        message = "; ".join(invalid_spec)
        conditions = [
            _condition("Ready", False, "InvalidSpec", message),
            _condition("Failed", True, "InvalidSpec", message),
            _condition("Complete", False, "InvalidSpec"),
            _condition("Suspended", bool(observed.suspended), "InvalidSpec"),
        ]
        return {
            "phase": "Failed",
            "observedGeneration": generation,
            "conditions": _stamp(conditions, previous, generation, now),
        }

    envs, inference, trainer = _environments(observed), _inference(observed), _trainer(observed)
    job = observed.job
    complete = _condition(
        "Complete",
        bool(job and job.succeeded),
        "TrainerSucceeded" if job and job.succeeded else "NotFinished",
    )
    failed = _condition(
        "Failed",
        bool(job and job.failed),
        (job.reason or "TrainerFailed") if job and job.failed else "NoFailure",
        job.message if job and job.failed else "",
    )
    suspended = (
        _condition("Suspended", observed.suspended, *observed.suspended_reason)
        if observed.suspended
        else (_condition("Suspended", False, "NotSuspended"))
    )
    parts = [envs, inference, trainer]
    if observed.problem is not None:
        ready = _condition("Ready", False, *observed.problem)
    elif all(c["status"] == "True" for c in parts):
        ready = _condition("Ready", True, "Running", "environments, inference and trainer are up")
    else:
        blocking = next(c for c in parts if c["status"] != "True")
        ready = _condition("Ready", False, blocking["reason"], f"{blocking['type']}: {blocking['message']}")

    if failed["status"] == "True":
        phase = "Failed"
    elif complete["status"] == "True":
        phase = "Succeeded"
    elif observed.suspended:
        phase = "Suspended"
    elif trainer["status"] == "True":
        phase = "Running"
    else:
        phase = "Pending"
    conditions = [ready, envs, inference, trainer, complete, failed, suspended]
    return {
        "phase": phase,
        "observedGeneration": generation,
        "conditions": _stamp(conditions, previous, generation, now),
    }


def _stamp(
    conditions: list[JSONDict], previous: Sequence[Mapping[str, Any]], generation: int, now: str
) -> list[JSONDict]:
    before = {c.get("type"): c for c in previous}
    for condition in conditions:
        old = before.get(condition["type"])
        unchanged = old is not None and old.get("status") == condition["status"] and old.get("lastTransitionTime")
        condition["lastTransitionTime"] = old["lastTransitionTime"] if unchanged and old else now
        condition["observedGeneration"] = generation
    return conditions


def same_conditions(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    """Equal ignoring order (used to skip no-op status writes)."""

    def key(items: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
        return sorted(tuple(sorted(c.items())) for c in items)

    return key(a) == key(b)


def curriculum_status(message: rl_pb2.CurriculumState, previous_metrics: Mapping[str, Any]) -> JSONDict:
    """The status patch for a CurriculumState (metrics that disappeared are removed: None in a merge patch)."""
    metrics = {key: float(value) for key, value in sorted(message.metrics.items())}
    patch: JSONDict = {
        "step": int(message.step),
        "stage": int(message.stage),
        "horizon": int(message.horizon),
        "metrics": {**{key: None for key in previous_metrics if key not in metrics}, **metrics},
    }
    reward = next((metrics[k] for k in REWARD_METRICS if k in metrics), None)
    if reward is not None:
        patch["reward"] = reward
    return patch


def weights_status(message: rl_pb2.WeightUpdate) -> JSONDict:
    return {"policyVersion": int(message.version), "lastCheckpoint": message.uri}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: ``patch`` applied to ``target`` (None removes a key), as the API server does."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: JSONDict = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def apply_status_patch(status: TrainingRunStatus, patch: Mapping[str, Any]) -> TrainingRunStatus:
    """`status` with a merge patch of the functions above applied (camelCase keys), as the operator's reaches
    the custom resource."""
    document = merge_patch(status.model_dump(by_alias=True, exclude_none=True), patch)
    return TrainingRunStatus.model_validate(document)
