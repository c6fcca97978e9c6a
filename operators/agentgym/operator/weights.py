"""Carrying new policy weights to every inference replica.

`WeightRoller` is the engine's reload API; two HTTP implementations:
- `HfWeightRoller`: the platform's HF engine, `POST /v1/load_weights {"uri", "version"}` and
  `GET /v1/policy_version`;
- `VllmWeightRoller`: vLLM's weight-transfer control plane (`VLLM_SERVER_DEV_MODE=1`, the shared-disk
  backend, `agentgym.inference.vllm_disk_backend`): pause (in-flight requests finish on the old weights, then
  vLLM's prefix cache is cleared), init/start/update/finish weight update with the checkpoint directory,
  resume; `GET /weight_info` reports the version (`default` before the first update: none to tell).

`sync_replicas` asks each ready replica which version it serves and reloads the ones behind. A replica
started from a checkpoint (pod annotation `agentgym.io/policy-version`) serves at least that version even
if its engine reports 0. What it returns tells the reconcile which version every replica serves and
whether any failed, in which case the inference Deployment is restarted onto the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from agentgym.inference.vllm import vllm_error_message
from agentgym.operator.manifests import POLICY_VERSION_ANNOTATION, Checkpoint, checkpoint_path
from agentgym.plan import HTTP_PORT


class WeightLoadError(Exception):
    """A replica did not load the weights (unreachable, unsupported, or the engine refused)."""


class WeightRoller(Protocol):
    async def served_version(self, endpoint: str) -> int | None:
        """The policy version the replica serves now (None when it cannot tell)."""
        ...

    async def load(self, endpoint: str, checkpoint: Checkpoint) -> None:
        """Make the replica serve `checkpoint`; raises WeightLoadError."""
        ...


async def _call(
    session: aiohttp.ClientSession, method: str, url: str, timeout: float, *, json: Any = None, params: Any = None
) -> Any:
    try:
        async with session.request(
            method, url, json=json, params=params, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            text = await response.text()
            if response.status >= 400:
                # The engine's reason (the HF engine and vLLM answer errors alike; a vLLM worker's is unwrapped).
                raise WeightLoadError(f"{method} {url} -> {response.status}: {vllm_error_message(text)[:500]}")
            if not text:
                return None
            try:
                return await response.json(content_type=None)
            except ValueError:
                return text
    except (aiohttp.ClientError, TimeoutError) as error:
        raise WeightLoadError(f"{method} {url} failed: {type(error).__name__}: {error}") from None


def _as_version(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("v").isdigit():
        return int(value.strip().lstrip("v"))
    return None


class HfWeightRoller:
    """The platform's HF engine."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float = 600.0) -> None:
        self.session = session
        self.timeout = timeout

    async def served_version(self, endpoint: str) -> int | None:
        try:
            reply = await _call(self.session, "GET", f"{endpoint}/v1/policy_version", 10.0)
        except WeightLoadError:
            return None
        if isinstance(reply, Mapping):
            for key in ("version", "policy_version", "policyVersion"):
                if key in reply:
                    return _as_version(reply[key])
            return None
        return _as_version(reply)

    async def load(self, endpoint: str, checkpoint: Checkpoint) -> None:
        body = {"uri": checkpoint.uri, "version": checkpoint.version}
        await _call(self.session, "POST", f"{endpoint}/v1/load_weights", self.timeout, json=body)


class VllmWeightRoller:
    """vLLM's RLHF weight-transfer routes with the shared-disk backend.

    Pauses with `mode=wait`, not `keep`: a kept request would go on sampling on the new weights with the old
    weights' KV (one sample from two policies), and `keep` leaves the prefix cache as it was. The disk backend
    checks the folder before it touches the model, so a refused update (bad path, other shapes) leaves the old
    weights serving, and resuming is safe; the replica reports the old version, and the caller retries or
    restarts it."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float = 600.0) -> None:
        self.session = session
        self.timeout = timeout

    async def served_version(self, endpoint: str) -> int | None:
        try:
            reply = await _call(self.session, "GET", f"{endpoint}/weight_info", 10.0)
        except WeightLoadError:
            return None
        return _as_version(reply.get("weight_version")) if isinstance(reply, Mapping) else None

    async def load(self, endpoint: str, checkpoint: Checkpoint) -> None:
        path = checkpoint_path(checkpoint.uri)
        if path is None:
            raise WeightLoadError(f"vLLM reloads from a directory every replica mounts, not {checkpoint.uri}")
        post = self._post
        await post(endpoint, "/init_weight_transfer_engine", {"init_info": {}})
        await post(endpoint, "/pause", None, params={"mode": "wait"})
        try:
            await post(endpoint, "/start_weight_update", None)
            await post(endpoint, "/update_weights", {"update_info": {"path": path}})
            await post(endpoint, "/finish_weight_update", {"weight_version": str(checkpoint.version)})
        except WeightLoadError:
            with contextlib.suppress(WeightLoadError):  # the refusal is the error to report, not the resume's
                await self._resume(endpoint)
            raise
        await self._resume(endpoint)

    async def _resume(self, endpoint: str) -> None:
        # vLLM closes the connection after a 500, and a pooled one may be reset: one retry (resume is idempotent).
        try:
            await self._post(endpoint, "/resume", None)
        except WeightLoadError:
            await asyncio.sleep(0.2)
            await self._post(endpoint, "/resume", None)

    async def _post(self, endpoint: str, route: str, body: Any, params: Any = None) -> None:
        await _call(self.session, "POST", f"{endpoint}{route}", self.timeout, json=body, params=params)


def roller_for(engine: str, session: aiohttp.ClientSession, timeout: float) -> WeightRoller:
    return VllmWeightRoller(session, timeout) if engine == "vllm" else HfWeightRoller(session, timeout)


@dataclass(frozen=True)
class Replica:
    pod: str
    endpoint: str
    started_version: int
    """The version its pod template started it on (0: the base model)."""


def ready_replicas(pods: Sequence[Mapping[str, Any]]) -> list[Replica]:
    """Running, ready, not terminating pods with an IP, as replicas to talk to."""
    replicas = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        if meta.get("deletionTimestamp") or status.get("phase") not in (None, "Running") or not status.get("podIP"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        if not ready:
            continue
        port = HTTP_PORT
        for container in pod.get("spec", {}).get("containers", []):
            for entry in container.get("ports", []):
                if entry.get("name") == "http":
                    port = int(entry["containerPort"])
        started = _as_version(meta.get("annotations", {}).get(POLICY_VERSION_ANNOTATION)) or 0
        replicas.append(Replica(pod=meta["name"], endpoint=f"http://{status['podIP']}:{port}", started_version=started))
    return sorted(replicas, key=lambda r: r.pod)


@dataclass
class SyncResult:
    served: int | None
    """The version every replica serves (the lowest); None when no replica is ready."""
    reloaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Pod -> why it could not load."""


async def sync_replicas(roller: WeightRoller, replicas: Sequence[Replica], latest: Checkpoint) -> SyncResult:
    """Bring every replica to `latest` (replicas already there or ahead are left alone)."""
    result = SyncResult(served=None)

    async def one(replica: Replica) -> int:
        reported = await roller.served_version(replica.endpoint)
        version = max(reported or 0, replica.started_version)
        if version >= latest.version:
            return version
        try:
            await roller.load(replica.endpoint, latest)
        except WeightLoadError as error:
            result.failed[replica.pod] = str(error)
            return version
        after = await roller.served_version(replica.endpoint)
        if after is not None and after < latest.version:
            result.failed[replica.pod] = f"reports v{after} after loading v{latest.version}"
            return max(after, replica.started_version)
        result.reloaded.append(replica.pod)
        return latest.version

    versions = await asyncio.gather(*(one(r) for r in replicas))
    result.served = min(versions) if versions else None
    result.reloaded.sort()
    return result
