"""A real Kubernetes CRD server for tests: k8s.io/apiextensions-apiserver on etcd (scripts/build-crd-server.sh).

The apiextensions-apiserver serves CustomResourceDefinitions and custom resources with the real API server's
code (structural schemas, defaulting, pruning, CEL, subresources, Table output). It is an extension server:
it reads the core API (namespaces for its admission, webhook configurations, authn/authz delegation) from
another server through a kubeconfig. Here that core API is the fidelity emulator, running in a thread, which
serves discovery and the lists the server's informers read (empty). Authorization
is the server's own rule that group system:masters may do anything: the tests log in with a client certificate
in that group, as a cluster admin's kubeconfig does (no kube-apiserver, no RBAC here).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import kmock
import yaml
from kube_emulator import FidelityKubernetesEmulator

from agentgym.messaging import free_port

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build-crd-server.sh"
ADMISSION_PLUGINS = [
    "NamespaceLifecycle",
    "MutatingAdmissionWebhook",
    "ValidatingAdmissionWebhook",
    "ValidatingAdmissionPolicy",
    "MutatingAdmissionPolicy",
]


def crd_server_binaries() -> Path | None:
    """The folder holding `apiextensions-apiserver` and `etcd`, or None when the script has not built them."""
    folder = Path(subprocess.run(["bash", str(BUILD_SCRIPT), "--path"], capture_output=True, text=True).stdout.strip())
    if (folder / "apiextensions-apiserver").is_file() and (folder / "etcd").is_file():
        return folder
    return None


@contextlib.contextmanager
def core_api_in_a_thread() -> Iterator[str]:
    """The fidelity emulator on its own event loop in a thread; yields its URL."""
    loop = asyncio.new_event_loop()
    started: threading.Event = threading.Event()
    stop: asyncio.Event | None = None
    url: list[str] = []
    failure: list[BaseException] = []

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with FidelityKubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            with warnings.catch_warnings():  # kmock 0.8 reads its bundled discovery with a deprecated API
                warnings.simplefilter("ignore", DeprecationWarning)
                emulator.resources.load_bundled()
            url.append(str(server.url).rstrip("/"))
            started.set()
            await stop.wait()

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as error:  # reported to the test, not lost in the thread
            failure.append(error)
            started.set()

    thread = threading.Thread(target=run, name="core-api", daemon=True)
    thread.start()
    started.wait(30)
    if failure or not url:
        raise RuntimeError(f"the core API emulator did not start: {failure}")
    try:
        yield url[0]
    finally:
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join(10)


@dataclass
class CrdServer:
    url: str
    log: Path
    client_cert: tuple[str, str]  # a cluster admin's (system:masters) certificate and key

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def client_ssl(self) -> ssl.SSLContext:
        """TLS as the admin client: its certificate presented, the server's self-signed one not checked."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(*self.client_cert)
        return context


def _admin_certificate(folder: Path) -> tuple[Path, tuple[str, str]]:
    """A client CA and a certificate it signs for group system:masters, which the server's authorizer always
    allows (as a cluster's admin kubeconfig is); made with openssl."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key, cert, key, request = (folder / n for n in ("ca.crt", "ca.key", "admin.crt", "admin.key", "admin.csr"))

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/O=system:masters/CN=admin",
            "-keyout", str(key), "-out", str(request))  # fmt: skip
    openssl("x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-days", "2", "-out", str(cert))  # fmt: skip
    return ca, (str(cert), str(key))


def _kubeconfig(path: Path, server: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "core",
        "contexts": [{"name": "core", "context": {"cluster": "core", "user": "core"}}],
        "clusters": [{"name": "core", "cluster": {"server": server}}],
        "users": [{"name": "core", "user": {"token": "core"}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            response = httpx.get(url, verify=False, timeout=2)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[-1500:]}"
        except httpx.HTTPError as error:
            last = repr(error)
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready in {timeout:.0f} s: {last}\n{log.read_text(errors='replace')[-4000:]}")


@contextlib.contextmanager
def running_crd_server(binaries: Path, workdir: Path) -> Iterator[CrdServer]:
    """etcd and the apiextensions-apiserver on free loopback ports, the emulator as their core API."""
    workdir.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with core_api_in_a_thread() as core:
            client_port, peer_port = free_port(), free_port()
            etcd_log = workdir / "etcd.log"
            etcd_url = f"http://127.0.0.1:{client_port}"
            with etcd_log.open("wb") as out:
                processes.append(
                    subprocess.Popen(
                        [
                            str(binaries / "etcd"),
                            f"--data-dir={workdir / 'etcd'}",
                            f"--listen-client-urls={etcd_url}",
                            f"--advertise-client-urls={etcd_url}",
                            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                            f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                            "--unsafe-no-fsync",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
            _wait_ready(f"{etcd_url}/health", processes[-1], etcd_log, 30)
            kubeconfig = _kubeconfig(workdir / "core.kubeconfig", core)
            client_ca, client_cert = _admin_certificate(workdir / "pki")
            port = free_port()
            log = workdir / "apiextensions-apiserver.log"
            with log.open("wb") as out:
                processes.append(
                    subprocess.Popen(
                        [
                            str(binaries / "apiextensions-apiserver"),
                            f"--etcd-servers={etcd_url}",
                            "--bind-address=127.0.0.1",
                            f"--secure-port={port}",
                            f"--cert-dir={workdir / 'certs'}",
                            f"--kubeconfig={kubeconfig}",
                            f"--authentication-kubeconfig={kubeconfig}",
                            f"--authorization-kubeconfig={kubeconfig}",
                            "--authentication-skip-lookup",
                            f"--client-ca-file={client_ca}",
                            "--enable-priority-and-fairness=false",
                            # Admission reads namespaces, webhook configurations and policies from the core
                            # API; none exists here (and the platform uses none): schema, CEL and defaults are
                            # the CRD server's own, not admission's.
                            f"--disable-admission-plugins={','.join(ADMISSION_PLUGINS)}",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
            url = f"https://127.0.0.1:{port}"
            _wait_ready(f"{url}/readyz", processes[-1], log, 90)
            yield CrdServer(url, log, client_cert)
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
