"""A small pod executor for the Kubernetes emulator: it plays the kubelet and the built-in Deployment and Job
controllers, so the pods the operator creates really run.

For every Deployment (its `spec.replicas`) and every unsuspended, unfinished Job (one pod), it starts each
pod's container as a local process with exactly its `command`, the pod's `env` (values, `valueFrom` Secret and
ConfigMap keys, `$(VAR)` expansion in env and command, as the kubelet does) and its `workingDir`:
- volumes: each pod runs in a mount namespace of its own (`unshare --mount`), where its ConfigMap and Secret
  volumes (their keys as files), emptyDirs (a folder per pod) and PersistentVolumeClaims (a folder per claim,
  shared by the pods that mount it) are bind-mounted at their `mountPath`s;
- network: each Deployment's pods get a loopback address of their own (127.0.0.x), where a wildcard bind lands
  (`podnet/sitecustomize.py`, loaded through PYTHONPATH), and `<service>.<namespace>.svc` resolves to the
  address of the pods the Service selects through the pod's `/etc/hosts` (the executor's hosts file
  bind-mounted there, as the kubelet manages a pod's /etc/hosts);
- readiness: the container's readinessProbe (httpGet) is polled; Deployments get `readyReplicas`, each pod is a
  Pod object with its IP and Ready condition (the operator rolls weights onto ready inference pods);
- restarts: a Deployment's pod that exits is started again (restartPolicy Always); a Job's failed pod is
  replaced up to `backoffLimit`, a pod that exits 0 completes the Job.

Not played: the scheduler, resource limits and requests, HPAs, NetworkPolicy enforcement, image contents and
the read-only root filesystem (the processes run this checkout's environment), liveness and startup probes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from operator_harness import Cluster

PODNET = Path(__file__).resolve().parent / "podnet"
CHECKOUT = Path(__file__).resolve().parents[2]
PARKED = Path("/run/agentgym-pod-checkout")  # a mount point outside /tmp
HOSTS_HEADER = "127.0.0.1 localhost\n::1 localhost\n"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class LocalPod:
    name: str
    owner: str
    """The Deployment or Job it belongs to."""
    template_hash: str
    ip: str
    process: subprocess.Popen[bytes]
    log: Path
    labels: dict[str, str] = field(default_factory=dict)
    ready: bool = False
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion (an unknown variable is left as written)."""
    return VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


class PodExecutor:
    """Runs the emulator's Deployments and Jobs as local processes until closed."""

    def __init__(self, cluster: Cluster, root: Path) -> None:
        self.cluster = cluster
        self.root = root
        self.hosts = root / "hosts"
        self.pods: dict[str, list[LocalPod]] = {}
        self.addresses: dict[str, str] = {}
        self.job_failures: dict[str, int] = {}
        self.finished_jobs: set[str] = set()
        self.started: list[str] = []  # every pod name started, in order
        self.restarts: dict[str, int] = {}  # owner -> container restarts, over all its pods
        self._task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        root.mkdir(parents=True, exist_ok=True)
        self.hosts.write_text(HOSTS_HEADER)

    async def __aenter__(self) -> PodExecutor:
        self._http = aiohttp.ClientSession()
        self._task = asyncio.create_task(self._loop(), name="pod-executor")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for owner in list(self.pods):
            for pod in self.pods.pop(owner):
                self._stop(pod)
        if self._http is not None:
            await self._http.close()

    def restarted(self, owner: str) -> int:
        return self.restarts.get(owner, 0)

    def pod(self, owner: str) -> LocalPod | None:
        pods = self.pods.get(owner) or []
        return pods[0] if pods else None

    # -- the control loop -----------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except (aiohttp.ClientError, OSError) as error:  # the API server is going away at the end
                print(f"pod executor: {error}", file=sys.stderr)
            await asyncio.sleep(0.5)

    async def _tick(self) -> None:
        deployments = await self.cluster.list("Deployment")
        jobs = await self.cluster.list("Job")
        live = {d["metadata"]["name"] for d in deployments} | {j["metadata"]["name"] for j in jobs}
        for owner in [o for o in self.pods if o not in live]:  # deleted: its pods go
            for pod in self.pods.pop(owner):
                await self._remove(pod)
        await self._services()  # first: the pods about to start find their Services
        for deployment in deployments:
            await self._deployment(deployment)
        for job in jobs:
            await self._job(job)

    async def _deployment(self, deployment: dict[str, Any]) -> None:
        name = deployment["metadata"]["name"]
        template = deployment["spec"]["template"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        want = int(deployment["spec"].get("replicas", 1))
        pods = self.pods.setdefault(name, [])
        for pod in [p for p in pods if p.template_hash != digest]:  # a new template: replace its pods
            pods.remove(pod)
            await self._remove(pod)
        while len(pods) > want:
            await self._remove(pods.pop())
        while len(pods) < want:
            pods.append(await self._start(name, template, digest, index=len(pods)))
        for pod in pods:
            if pod.process.poll() is not None:  # restartPolicy Always: the kubelet starts the container again
                pod.exit_codes.append(int(pod.process.returncode))
                pod.restarts += 1
                self.restarts[name] = self.restarts.get(name, 0) + 1
                pod.ready = False
                pod.process = await self._spawn(pod.name, pod.ip, template, pod.log)
            await self._probe(pod, template)
        ready = sum(p.ready for p in pods)
        status = {
            "observedGeneration": deployment["metadata"].get("generation", 1),
            "replicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": len(pods),
        }
        if any(deployment.get("status", {}).get(k) != v for k, v in status.items()):
            await self.cluster.patch("Deployment", name, {"status": status}, subresource="status")

    async def _job(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        template = job["spec"]["template"]
        pods = self.pods.setdefault(name, [])
        if job["spec"].get("suspend") or name in self.finished_jobs:
            for pod in pods:
                await self._remove(pod)
            pods.clear()
            if job["spec"].get("suspend") and job.get("status", {}).get("active"):
                await self.cluster.patch("Job", name, {"status": {"active": 0}}, subresource="status")
            return
        if not pods:
            pods.append(await self._start(name, template, "job", index=self.job_failures.get(name, 0)))
        pod = pods[0]
        code = pod.process.poll()
        if code is None:
            if job.get("status", {}).get("active") != 1:
                await self.cluster.patch("Job", name, {"status": {"active": 1}}, subresource="status")
            return
        pods.clear()
        await self._remove(pod)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if code == 0:
            self.finished_jobs.add(name)
            status = {"active": 0, "succeeded": 1, "completionTime": now}
            status["conditions"] = [{"type": "Complete", "status": "True", "lastTransitionTime": now}]
            await self.cluster.patch("Job", name, {"status": status}, subresource="status")
            return
        self.job_failures[name] = failures = self.job_failures.get(name, 0) + 1
        if failures > int(job["spec"].get("backoffLimit", 6)):
            self.finished_jobs.add(name)
            condition = {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "lastTransitionTime": now,
            }
            status = {"active": 0, "failed": failures, "conditions": [condition]}
            await self.cluster.patch("Job", name, {"status": status}, subresource="status")
        else:
            await self.cluster.patch("Job", name, {"status": {"active": 0, "failed": failures}}, subresource="status")

    async def _services(self) -> None:
        """Each Service's DNS name -> the address of the Deployment it selects (all its pods share one)."""
        lines = []
        for service in await self.cluster.list("Service"):
            selector = service["spec"].get("selector") or {}
            for deployment in await self.cluster.list("Deployment"):
                labels = deployment["spec"]["template"]["metadata"].get("labels", {})
                if selector and selector.items() <= labels.items():
                    address = self._address(deployment["metadata"]["name"])
                    meta = service["metadata"]
                    lines.append(f"{address} {meta['name']}.{meta['namespace']}.svc {meta['name']}")
        text = HOSTS_HEADER + "".join(f"{line}\n" for line in sorted(lines))
        if self.hosts.read_text() != text:
            # In place, not replaced: the pods see this file through a bind mount of its inode.
            with self.hosts.open("r+") as handle:
                handle.write(text)
                handle.truncate()

    def _address(self, owner: str) -> str:
        return self.addresses.setdefault(owner, f"127.0.0.{len(self.addresses) + 2}")

    # -- one pod ---------------------------------------------------------------------------------------------------

    async def _start(self, owner: str, template: dict[str, Any], digest: str, *, index: int) -> LocalPod:
        ip = self._address(owner)
        name = f"{owner}-{digest[:5]}-{index}"
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        process = await self._spawn(name, ip, template, log)
        labels = dict(template["metadata"].get("labels", {}))
        pod = LocalPod(name=name, owner=owner, template_hash=digest, ip=ip, process=process, log=log, labels=labels)
        self.started.append(name)
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": labels,
                "annotations": dict(template["metadata"].get("annotations", {})),
            },
            "spec": template["spec"],
        }
        await self.cluster.create("Pod", body)
        await self._pod_status(pod)
        return pod

    async def _spawn(self, name: str, ip: str, template: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
        spec = template["spec"]
        (container,) = spec["containers"]  # the platform's pods have one container each
        env = await self._environment(container)
        env.update(
            PATH=os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
            PYTHONPATH=str(PODNET),
            AGENTGYM_POD_IP=ip,
        )
        command = [expand(part, env) for part in container["command"] + container.get("args", [])]
        await self._materialize(name, spec)
        binds = [(str(self.hosts), "/etc/hosts"), *self._volumes(name, spec, container)]
        # /tmp last: the other sources live under it.
        binds.sort(key=lambda pair: pair[1] == "/tmp")
        steps = [f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}" for src, dst in binds]
        if any(dst == "/tmp" for _, dst in binds) and CHECKOUT.is_relative_to("/tmp"):
            # The checkout (its .venv: the image's contents here) lies under /tmp, which the pod's own /tmp
            # covers: keep it reachable, parked outside /tmp while the pod's /tmp is mounted.
            code = shlex.quote(str(CHECKOUT))
            steps.insert(-1, f"mount --bind {code} {PARKED}")
            steps += [f"mkdir -p {code}", f"mount --bind {PARKED} {code}"]
            PARKED.mkdir(parents=True, exist_ok=True)
        script = " && ".join([*steps, f"cd {shlex.quote(container.get('workingDir', '/'))}", 'exec "$@"'])
        for _, target in binds[1:]:  # mount points exist on the host (empty folders; the pods' own views differ)
            Path(target).mkdir(parents=True, exist_ok=True)
        Path(container.get("workingDir", "/")).mkdir(parents=True, exist_ok=True)
        handle = log.open("ab")
        try:
            return subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "pod", *command],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            handle.close()

    def _volumes(self, pod: str, spec: dict[str, Any], container: dict[str, Any]) -> list[tuple[str, str]]:
        sources: dict[str, Path] = {}
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                path = self.root / "claims" / volume["persistentVolumeClaim"]["claimName"]
            else:
                path = self.root / "pods" / pod / "volumes" / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            sources[volume["name"]] = path
        return [(str(sources[m["name"]]), m["mountPath"]) for m in container.get("volumeMounts", [])]

    async def _materialize(self, pod: str, spec: dict[str, Any]) -> None:
        for volume in spec.get("volumes", []):
            target = self.root / "pods" / pod / "volumes" / volume["name"]
            if "configMap" in volume:
                source = await self.cluster.get("ConfigMap", volume["configMap"]["name"])
                data = (source or {}).get("data", {})
            elif "secret" in volume:
                source = await self.cluster.get("Secret", volume["secret"]["secretName"])
                data = {k: base64.b64decode(v).decode() for k, v in ((source or {}).get("data") or {}).items()}
            else:
                continue
            target.mkdir(parents=True, exist_ok=True)
            for key, value in data.items():
                (target / key).write_text(value)

    async def _environment(self, container: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for entry in container.get("env", []):
            if "value" in entry:
                env[entry["name"]] = expand(str(entry["value"]), env)
                continue
            source = entry["valueFrom"]
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = await self.cluster.get("Secret", ref["name"])
                assert secret is not None, f"Secret {ref['name']} is missing"
                env[entry["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                config_map = await self.cluster.get("ConfigMap", ref["name"])
                assert config_map is not None, f"ConfigMap {ref['name']} is missing"
                env[entry["name"]] = config_map["data"][ref["key"]]
        return env

    async def _probe(self, pod: LocalPod, template: dict[str, Any]) -> None:
        (container,) = template["spec"]["containers"]
        probe = container.get("readinessProbe")
        ready = pod.process.poll() is None
        if ready and probe is not None:
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            get = probe["httpGet"]
            port = ports.get(get["port"], get["port"])
            assert self._http is not None
            try:
                async with self._http.get(
                    f"http://{pod.ip}:{port}{get['path']}", timeout=aiohttp.ClientTimeout(total=2)
                ) as response:
                    ready = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ready = False
        if ready != pod.ready:
            pod.ready = ready
            await self._pod_status(pod)

    async def _pod_status(self, pod: LocalPod) -> None:
        status = {
            "phase": "Running",
            "podIP": pod.ip,
            "conditions": [{"type": "Ready", "status": "True" if pod.ready else "False"}],
            "containerStatuses": [{"name": "main", "ready": pod.ready, "restartCount": pod.restarts}],
        }
        with contextlib.suppress(Exception):
            await self.cluster.patch("Pod", pod.name, {"status": status}, subresource="status")

    def _stop(self, pod: LocalPod) -> None:
        if pod.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.process.pid, signal.SIGTERM)
            try:
                pod.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(pod.process.pid, signal.SIGKILL)
                pod.process.wait()

    async def _remove(self, pod: LocalPod) -> None:
        await asyncio.to_thread(self._stop, pod)
        with contextlib.suppress(Exception):
            await self.cluster.delete("Pod", pod.name)
