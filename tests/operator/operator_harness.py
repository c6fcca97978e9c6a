"""Helpers for running the real operator (kopf) against the fidelity kmock API server and a real nats-server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import kopf
import yaml

from agentgym.operator.config import NatsSettings, OperatorConfig
from agentgym.operator.handlers import build_registry

NAMESPACE = "ml"
OPERATOR_NAMESPACE = "agentgym-system"
RESYNC = 0.5

PATHS = {
    "TrainingRun": "/apis/agentgym.io/v1alpha1/namespaces/{ns}/trainingruns",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "Service": "/api/v1/namespaces/{ns}/services",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "Event": "/api/v1/namespaces/{ns}/events",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
}


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{status}: {body}")


@dataclass
class Cluster:
    """A thin client over the emulated API server: what `kubectl` would do in these tests."""

    session: aiohttp.ClientSession
    namespace: str = NAMESPACE

    def path(self, kind: str, name: str | None = None, subresource: str | None = None) -> str:
        path = PATHS[kind].format(ns=self.namespace)
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        async with self.session.request(method, path, **kwargs) as response:
            body = await response.json(content_type=None)
            if response.status >= 400:
                raise ApiError(response.status, body)
            return body

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self._call("GET", self.path(kind, name))
            return result
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, kind: str) -> list[dict[str, Any]]:
        listing = await self._call("GET", self.path(kind))
        items: list[dict[str, Any]] = listing["items"]
        return items

    async def create(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", self.path(kind), json=obj)
        return result

    async def patch(self, kind: str, name: str, patch: dict[str, Any], subresource: str | None = None) -> Any:
        headers = {"Content-Type": "application/merge-patch+json"}
        return await self._call("PATCH", self.path(kind, name, subresource), json=patch, headers=headers)

    async def delete(self, kind: str, name: str) -> Any:
        return await self._call("DELETE", self.path(kind, name))

    async def wait_for(
        self, probe: Callable[[], Awaitable[Any]], *, timeout: float = 30.0, what: str = "condition"
    ) -> Any:
        """Poll `probe` until it returns something truthy; fail with the last value seen."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await probe()
            if last:
                return last
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last seen: {json.dumps(last, default=str)[:2000]}")

    async def status_of(self, run: str) -> dict[str, Any]:
        obj = await self.get("TrainingRun", run)
        return (obj or {}).get("status") or {}

    async def events_for(self, run: str) -> list[dict[str, Any]]:
        return [e for e in await self.list("Event") if e.get("involvedObject", {}).get("name") == run]


@dataclass
class FakeEngine:
    """The HF engine's weight API (agentgym.inference.server) on a local port: `POST /v1/load_weights`,
    `GET /v1/policy_version`, with its reply and error shapes."""

    version: int = 0
    fail_loads: bool = False
    loads: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    def app(self) -> aiohttp.web.Application:
        app = aiohttp.web.Application()
        app.router.add_get("/v1/policy_version", self._version)
        app.router.add_post("/v1/load_weights", self._load)
        return app

    async def _version(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"policy_version": self.version})

    async def _load(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        body = await request.json()
        self.loads.append(body)
        if self.fail_loads:
            message = f"cannot read {body['uri']}; still serving policy version {self.version}"
            return aiohttp.web.json_response(
                {"error": {"message": message, "type": "invalid_request_error"}}, status=400
            )
        if int(body["version"]) < self.version:
            return aiohttp.web.json_response({"error": {"message": "stale version"}}, status=409)
        self.version = int(body["version"])
        return aiohttp.web.json_response({"policy_version": self.version, "model": "builtin:tiny"})


def load_example(name: str) -> dict[str, Any]:
    path = Path(__file__).resolve().parents[2] / "examples" / name
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


def secret_value(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


@dataclass
class OperatorHandle:
    config: OperatorConfig
    thread: threading.Thread
    stop: threading.Event


@contextlib.asynccontextmanager
async def running_operator(config: OperatorConfig) -> AsyncIterator[OperatorHandle]:
    """The operator in its own thread and event loop, as in a pod (kopf's own KopfRunner does the same).

    Its own loop also keeps kopf's shutdown, which cancels every task started after it, away from the
    test's loop (the API server and NATS clients of the test live there).
    """
    stop, ready = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=build_registry(config.resync_seconds),
                    memo=kopf.Memo(config=config),
                    standalone=True,
                    namespaces=[NAMESPACE],
                    stop_flag=stop,
                    ready_flag=ready,
                )
            )
        except BaseException as error:  # surfaced in the test
            failures.append(error)

    thread = threading.Thread(target=serve, name="operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 20), f"the operator did not start: {failures}"
    try:
        yield OperatorHandle(config=config, thread=thread, stop=stop)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive(), "the operator did not stop within 30 s"
        if failures:
            raise failures[0]


def operator_config(nats_url: str) -> OperatorConfig:
    return OperatorConfig(
        nats=NatsSettings(url=nats_url, connect_timeout_seconds=1.0),
        resync_seconds=RESYNC,
        operator_namespace=OPERATOR_NAMESPACE,
        otlp_endpoint="http://collector.agentgym-system.svc:4318",
    )
