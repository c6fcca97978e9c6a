"""Fixtures: the fidelity kmock API server, a real nats-server, fake inference replicas, the running operator."""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import kmock
import pytest
import yaml
from kube_emulator import FidelityKubernetesEmulator
from operator_harness import NAMESPACE, Cluster, FakeEngine, OperatorHandle, operator_config, running_operator

from agentgym.messaging import EmbeddedNats
from agentgym.spec.crd import crd_document


@pytest.fixture
async def api() -> AsyncIterator[FidelityKubernetesEmulator]:
    async with FidelityKubernetesEmulator() as emulator, kmock.Server(emulator):
        with warnings.catch_warnings():  # kmock 0.8 reads its bundled discovery data with a deprecated API
            warnings.simplefilter("ignore", DeprecationWarning)
            emulator.resources.load_bundled()
        emulator.register_crd(crd_document())
        yield emulator


@pytest.fixture
async def cluster(api: FidelityKubernetesEmulator) -> AsyncIterator[Cluster]:
    async with aiohttp.ClientSession(str(api.url).rstrip("/")) as session:
        yield Cluster(session)


@pytest.fixture
def kubeconfig(api: FidelityKubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The operator logs in through its normal path (kopf's kubeconfig login), pointed at the emulator."""
    path = tmp_path / "kubeconfig"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": NAMESPACE}}],
        "clusters": [{"name": "test", "cluster": {"server": str(api.url).rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": "test-token"}}],
    }
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    for variable in ("NATS_USER", "NATS_PASSWORD", "NATS_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    return path


@pytest.fixture
def nats_server(tmp_path: Path) -> Any:
    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    """Two fake inference replicas on loopback."""
    fakes, runners = [FakeEngine(), FakeEngine()], []
    for fake in fakes:
        runner = aiohttp.web.AppRunner(fake.app())
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fake.port = runner.addresses[0][1]
        runners.append(runner)
    yield fakes
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def operator(kubeconfig: Path, nats_server: EmbeddedNats) -> AsyncIterator[OperatorHandle]:
    async with running_operator(operator_config(nats_server.url)) as handle:
        yield handle
