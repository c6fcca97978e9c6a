"""A small async Kubernetes REST client for the operator's children (get, create, merge-patch, delete, list).

It authenticates with kopf's own `ConnectionInfo` (service account in the cluster, kubeconfig outside),
obtained through a login function; on a 401 it logs in again once (bound service-account tokens
rotate). Errors are typed so the handlers can tell a temporary failure from a permanent one.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

JSONDict = dict[str, Any]
LoginFn = Callable[[], kopf.ConnectionInfo | None]

# The kinds the operator touches: (apiVersion, kind) -> plural.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("batch/v1", "Job"): "jobs",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("agentgym.io/v1alpha1", "TrainingRun"): "trainingruns",
}


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str

    @property
    def plural(self) -> str:
        return PLURALS[(self.api_version, self.kind)]

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Kind:
        return cls(obj["apiVersion"], obj["kind"])


CONFIGMAP = Kind("v1", "ConfigMap")
SECRET = Kind("v1", "Secret")
SERVICE = Kind("v1", "Service")
POD = Kind("v1", "Pod")
PVC = Kind("v1", "PersistentVolumeClaim")
DEPLOYMENT = Kind("apps/v1", "Deployment")
JOB = Kind("batch/v1", "Job")
HPA = Kind("autoscaling/v2", "HorizontalPodAutoscaler")
NETWORK_POLICY = Kind("networking.k8s.io/v1", "NetworkPolicy")
TRAINING_RUN = Kind("agentgym.io/v1alpha1", "TrainingRun")


class KubeError(Exception):
    """An API error: `status` is the HTTP status (0 for a connection failure)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}")

    @property
    def temporary(self) -> bool:
        """Worth retrying: connection failures, conflicts, throttling, server errors, forbidden (quota/RBAC fixes)."""
        return self.status in (0, 401, 403, 408, 409, 429) or self.status >= 500


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    pass


class KubeClient:
    """Async client over one aiohttp session; call `close()` when done."""

    def __init__(self, login: LoginFn, *, timeout: float = 30.0) -> None:
        self._login = login
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._tempfiles: list[tempfile._TemporaryFileWrapper[bytes]] = []

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        for handle in self._tempfiles:
            handle.close()
        self._tempfiles.clear()

    # -- connection -------------------------------------------------------------------------------------------------

    def _connect(self) -> None:
        info = self._login()
        if info is None:
            raise KubeError(0, "NoCredentials", "no Kubernetes credentials (neither in-cluster nor a kubeconfig)")
        self._info = info
        if self._session is not None and not self._session.closed:
            # Only the headers change on re-login; keep the connection pool.
            return
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl_context(info), limit=32), timeout=self._timeout
        )

    def _ssl_context(self, info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
        if not info.server.startswith("https"):
            return False
        if info.insecure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif info.ca_path or info.ca_data:
            cadata = None
            if info.ca_data:
                raw = info.ca_data.encode() if isinstance(info.ca_data, str) else info.ca_data
                cadata = base64.b64decode(raw).decode()
            context = ssl.create_default_context(cafile=info.ca_path, cadata=cadata)
        else:
            context = ssl.create_default_context()
        cert, key = info.certificate_path, info.private_key_path
        if info.certificate_data:
            cert = self._materialise(info.certificate_data)
        if info.private_key_data:
            key = self._materialise(info.private_key_data)
        if cert:
            context.load_cert_chain(certfile=cert, keyfile=key)
        return context

    def _materialise(self, data: str | bytes) -> str:
        handle = tempfile.NamedTemporaryFile(suffix=".pem")  # noqa: SIM115 - kept open for the client's life
        handle.write(base64.b64decode(data.encode() if isinstance(data, str) else data))
        handle.flush()
        self._tempfiles.append(handle)
        return handle.name

    def _headers(self) -> dict[str, str]:
        assert self._info is not None
        headers = {"Accept": "application/json", "User-Agent": "agentgym-operator"}
        if self._info.token:
            headers["Authorization"] = f"{self._info.scheme or 'Bearer'} {self._info.token}"
        elif self._info.username and self._info.password:
            raw = f"{self._info.username}:{self._info.password}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JSONDict:
        for attempt in (1, 2):
            if self._info is None or self._session is None:
                self._connect()
            assert self._info is not None and self._session is not None
            headers = self._headers()
            if json is not None:
                headers["Content-Type"] = content_type
            url = self._info.server.rstrip("/") + path
            try:
                async with self._session.request(method, url, json=json, params=params, headers=headers) as response:
                    if response.status == 401 and attempt == 1:
                        self._info = None  # log in again: the token may have rotated
                        continue
                    payload = await response.json(content_type=None) if response.content_length != 0 else {}
                    if response.status >= 400:
                        raise _error(response.status, payload)
                    return payload if isinstance(payload, dict) else {}
            except (aiohttp.ClientConnectionError, TimeoutError) as error:
                raise KubeError(0, type(error).__name__, str(error)) from None
        raise KubeError(401, "Unauthorized", "the API server rejected the credentials twice")

    # -- verbs --------------------------------------------------------------------------------------------------------

    async def get(self, kind: Kind, namespace: str, name: str) -> JSONDict | None:
        try:
            return await self.request("GET", kind.path(namespace, name))
        except NotFound:
            return None

    async def list(self, kind: Kind, namespace: str, label_selector: Mapping[str, str]) -> list[JSONDict]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(label_selector.items()))
        listing = await self.request("GET", kind.path(namespace), params={"labelSelector": selector})
        items: list[JSONDict] = listing.get("items", [])
        return items

    async def create(self, obj: Mapping[str, Any]) -> JSONDict:
        return await self.request("POST", Kind.of(obj).path(obj["metadata"]["namespace"]), json=dict(obj))

    async def patch(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any], *, subresource: str | None = None
    ) -> JSONDict:
        path = kind.path(namespace, name, subresource)
        return await self.request("PATCH", path, json=dict(patch), content_type="application/merge-patch+json")

    async def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete (background propagation); False when it was already gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", kind.path(namespace, name), json=body)
        except NotFound:
            return False
        return True


def _error(status: int, payload: Any) -> KubeError:
    reason = payload.get("reason", "") if isinstance(payload, dict) else ""
    message = payload.get("message", "") if isinstance(payload, dict) else str(payload)
    if status == 404:
        return NotFound(status, reason or "NotFound", message)
    if status == 409:
        return Conflict(status, reason or "Conflict", message)
    return KubeError(status, reason or "Error", message)
