"""The kopf handlers of the TrainingRun operator.

    registry = build_registry(resync_seconds=15)
    await kopf.operator(registry=registry, memo=kopf.Memo(config=load_config()), standalone=True, ...)

- startup/cleanup: settings (finalizer and progress in `agentgym.io` annotations, no cluster-wide
  scanning, only warnings posted as events) and the shared clients (`Platform`) in the memo;
- login: the service account in a pod, else the kubeconfig; the children's client uses the same;
- create/update/resume: reconcile now; a resync timer reconciles again (drift, readiness, completion);
- a daemon per run follows its NATS control subjects: CurriculumState and WeightUpdate into the status,
  and on each new policy version a reconcile that rolls the weights onto inference;
- delete (finalizer): the run's NATS streams are deleted; children go with the garbage collector.

Temporary problems (NATS or API server unreachable, conflicts) raise `kopf.TemporaryError` with an
exponential backoff; an invalid spec or a child the API server rejects raise `kopf.PermanentError`
after the reason is written into the status (a `Failed`/`Ready` condition) and posted as an event.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import aiohttp
import kopf
import nats.errors

from agentgym.lifecycle import curriculum_status, weights_status
from agentgym.messaging import RunChannels, ensure_run_streams
from agentgym.operator import kube
from agentgym.operator.config import OperatorConfig
from agentgym.operator.kube import KubeClient, KubeError
from agentgym.operator.natsbus import (
    NatsPool,
    NatsUnavailable,
    decode_control,
    subscribe_control,
)
from agentgym.operator.reconcile import (
    EventSink,
    InvalidSpec,
    Platform,
    Rejected,
    Retry,
    delete_streams,
    reconcile,
    resolve_nats_url,
    run_streams_url,
    write_status,
)
from agentgym.proto import rl_pb2
from agentgym.spec import API_GROUP, API_VERSION, PLURAL

FINALIZER = f"{API_GROUP}/cleanup"
RUNS = (API_GROUP, API_VERSION, PLURAL)
MAX_BACKOFF = 300.0
CLEANUP_ATTEMPTS = 6


def backoff(retry: int) -> float:
    """1, 2, 4, ... seconds, at most five minutes."""
    return float(min(MAX_BACKOFF, 2 ** min(retry, 16)))


def _login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)


def _as_body(body: Mapping[str, Any]) -> kopf.Body:
    return body if isinstance(body, kopf.Body) else kopf.Body(cast(kopf.RawBody, dict(body)))


def _emitter(body: Mapping[str, Any]) -> EventSink:
    target = _as_body(body)

    def emit(kind: str, reason: str, message: str) -> None:
        kopf.event(target, type=kind, reason=reason, message=message[:1000])

    return emit


# ---------------------------------------------------------------------------------------------------------------------
# activities
# ---------------------------------------------------------------------------------------------------------------------


async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.scanning.disabled = True  # no cluster-wide namespace/CRD watches: least privilege
    settings.posting.level = logging.WARNING
    settings.background.cancellation_polling = 1.0  # a deleted run waits for its resync timer to exit (default 60 s)
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    config: OperatorConfig = memo.get("config") or OperatorConfig()
    memo["config"] = config
    memo["platform"] = Platform(
        config=config,
        kube=KubeClient(lambda: _login(settings)),
        nats=NatsPool(config.nats.connect_timeout_seconds),
        http=aiohttp.ClientSession(),
    )


def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    return _login(settings)


async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    platform: Platform | None = memo.get("platform")
    if platform is not None:
        await platform.close()


# ---------------------------------------------------------------------------------------------------------------------
# reconciliation
# ---------------------------------------------------------------------------------------------------------------------


async def _fresh(platform: Platform, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The run as stored now (the body kopf passed may predate a status write); None once it is gone."""
    meta = body["metadata"]
    fresh = await platform.kube.get(kube.TRAINING_RUN, meta["namespace"], meta["name"])
    if fresh is None or fresh["metadata"].get("uid") != meta["uid"]:
        return None
    return fresh


async def _reconcile_now(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int) -> None:
    platform: Platform = memo["platform"]
    async with platform.lock(body["metadata"]["uid"]):
        try:
            fresh = await _fresh(platform, body)
            if fresh is None:
                return
            await reconcile(platform, fresh, emit=_emitter(body), logger=logger)
        except InvalidSpec as error:
            raise kopf.PermanentError(str(error)) from None
        except Rejected as error:
            raise kopf.PermanentError(str(error)) from None
        except Retry as error:
            raise kopf.TemporaryError(str(error), delay=backoff(retry)) from None
        except KubeError as error:
            if error.temporary:
                raise kopf.TemporaryError(f"Kubernetes API: {error}", delay=backoff(retry)) from None
            raise kopf.PermanentError(f"Kubernetes API: {error}") from None


async def reconcile_created(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int, **_: Any) -> None:
    await _reconcile_now(body, memo, logger, retry)


async def reconcile_updated(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int, **_: Any) -> None:
    await _reconcile_now(body, memo, logger, retry)


async def reconcile_resumed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int, **_: Any) -> None:
    await _reconcile_now(body, memo, logger, retry)


async def resync(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """The drift check: failures are logged and the next tick tries again (events were posted already)."""
    platform: Platform = memo["platform"]
    async with platform.lock(body["metadata"]["uid"]):
        try:
            fresh = await _fresh(platform, body)
            if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                return
            await reconcile(platform, fresh, emit=_emitter(body), logger=logger)
        except (InvalidSpec, Rejected) as error:
            logger.debug(f"resync: {error}")
        except (Retry, KubeError) as error:
            logger.warning(f"resync: {error}; retrying on the next tick")


# ---------------------------------------------------------------------------------------------------------------------
# NATS control messages -> status, weights -> inference
# ---------------------------------------------------------------------------------------------------------------------


async def follow_control(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, stopped: kopf.DaemonStopped, retry: int, **_: Any
) -> None:
    """Write each CurriculumState/WeightUpdate of the run into its status; roll new weights to inference."""
    platform: Platform = memo["platform"]
    name = body["metadata"]["name"]
    try:
        _run, url = await run_streams_url(platform, body)
        js = await platform.nats.jetstream(url)
        await ensure_run_streams(js, RunChannels(name))  # the daemon may start before the first reconcile
        subscription = await subscribe_control(js, RunChannels(name))
    except InvalidSpec:
        return  # reported by the reconcile; the daemon restarts when the spec changes
    except (Retry, KubeError, NatsUnavailable, nats.errors.Error, OSError, TimeoutError) as error:
        raise kopf.TemporaryError(f"cannot follow the control subjects: {error}", delay=backoff(retry)) from None
    channels = RunChannels(name)
    status = body.get("status") or {}
    last_step = int(status.get("step") or -1)
    last_version = int(status.get("policyVersion") or 0)
    metrics: Mapping[str, Any] = status.get("metrics") or {}
    try:
        while not stopped:
            try:
                message = await subscription.next_msg(timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            control = decode_control(channels, message.subject, message.data)
            if isinstance(control, rl_pb2.CurriculumState) and control.step >= last_step:
                patch = curriculum_status(control, metrics)
                await write_status(platform.kube, body, patch)
                last_step, metrics = control.step, {k: v for k, v in patch["metrics"].items() if v is not None}
                logger.info(f"step {control.step}: stage {control.stage}, horizon {control.horizon}")
            elif isinstance(control, rl_pb2.WeightUpdate) and control.version > last_version:
                await write_status(platform.kube, body, weights_status(control))
                last_version = control.version
                logger.info(f"policy v{control.version} at {control.uri}: rolling it onto inference")
                await _roll_weights(platform, body, logger)
    except (nats.errors.Error, KubeError, TimeoutError) as error:
        raise kopf.TemporaryError(f"following the control subjects failed: {error}", delay=backoff(retry)) from None
    finally:
        try:
            await subscription.unsubscribe()
        except nats.errors.Error as error:
            logger.debug(f"unsubscribe: {error}")


async def _roll_weights(platform: Platform, body: kopf.Body, logger: kopf.Logger) -> None:
    async with platform.lock(body["metadata"]["uid"]):
        fresh = await _fresh(platform, body)
        if fresh is None or fresh["metadata"].get("deletionTimestamp"):
            return
        try:
            await reconcile(platform, fresh, emit=_emitter(body), logger=logger)
        except (InvalidSpec, Rejected, Retry) as error:
            logger.warning(f"after a weight update: {error}")


# ---------------------------------------------------------------------------------------------------------------------
# deletion
# ---------------------------------------------------------------------------------------------------------------------


async def cleanup(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int, **_: Any) -> None:
    """Delete the run's NATS streams (the finalizer); gives up after a few attempts rather than block deletion."""
    platform: Platform = memo["platform"]
    name, uid = body["metadata"]["name"], body["metadata"]["uid"]
    try:
        try:
            _run, url = await run_streams_url(platform, body)
        except InvalidSpec:
            url = platform.config.platform_nats_url()  # an invalid run can only have streams on the platform's NATS
        deleted = await delete_streams(platform, url, name)
    except (Retry, KubeError) as error:
        if retry + 1 < CLEANUP_ATTEMPTS:
            raise kopf.TemporaryError(f"cannot delete the run's streams yet: {error}", delay=backoff(retry)) from None
        message = f"gave up deleting the NATS streams after {CLEANUP_ATTEMPTS} attempts: {error}"
        kopf.warn(_as_body(body), reason="StreamsNotDeleted", message=message)
        deleted = []
    logger.info(f"deleted NATS streams: {', '.join(deleted) or 'none existed'}")
    platform.locks.pop(uid, None)


# ---------------------------------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------------------------------


def build_registry(resync_seconds: float = 15.0) -> kopf.OperatorRegistry:
    """A registry with every handler of the operator (its own, so tests can run several operators)."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(shutdown)
    kopf.on.create(*RUNS, registry=registry, id="reconcile-created")(reconcile_created)
    kopf.on.update(*RUNS, registry=registry, id="reconcile-updated")(reconcile_updated)
    kopf.on.resume(*RUNS, registry=registry, id="reconcile-resumed")(reconcile_resumed)
    kopf.timer(*RUNS, registry=registry, id="resync", interval=resync_seconds, initial_delay=resync_seconds)(resync)
    kopf.daemon(*RUNS, registry=registry, id="control", cancellation_timeout=5.0)(follow_control)
    kopf.on.delete(*RUNS, registry=registry, id="cleanup")(cleanup)
    return registry


__all__ = ["FINALIZER", "backoff", "build_registry", "resolve_nats_url"]
