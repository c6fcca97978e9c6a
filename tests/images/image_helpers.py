"""Helpers of the image tests: podman, and containers started the way the operator's and the chart's pod specs run
them (their command, user, read-only root filesystem, dropped capabilities, emptyDirs as tmpfs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build-images.sh"
CACHE = Path(os.environ.get("AGENTGYM_IMAGES_CACHE", Path.home() / ".cache" / "agentgym-images"))
TAG = os.environ.get("AGENTGYM_IMAGE_TAG", "latest")
SIZES_FILE = Path(__file__).with_name("sizes.json")
IMAGE_NAMES: list[str] = re.search(r"^ORDER=\(([^)]*)\)", BUILD_SCRIPT.read_text(), re.M)[1].split()  # type: ignore[index]
"""Every image scripts/build-images.sh builds, in its build order."""


@dataclass(frozen=True)
class BuiltImage:
    name: str
    reference: str
    size_mb: int
    build_s: int


SELECTED_VAR = "AGENTGYM_IMAGES"
"""Space-separated image names to build and test (default: all of IMAGE_NAMES). CI selects a subset."""


def selected_images() -> list[str]:
    """The images this session builds and tests, in build order; an unknown name is an error naming it."""
    wanted = os.environ.get(SELECTED_VAR, "").split()
    unknown = sorted(set(wanted) - set(IMAGE_NAMES))
    if unknown:
        raise ValueError(f"{SELECTED_VAR} names unknown images {unknown}; known: {' '.join(IMAGE_NAMES)}")
    return [name for name in IMAGE_NAMES if name in wanted] if wanted else list(IMAGE_NAMES)


def built_reference(built: Mapping[str, BuiltImage], name: str) -> str:
    """The reference of a built image; the test is skipped, saying why, when this session did not build it."""
    if name not in built:
        pytest.skip(f"{name} is not built in this session ({SELECTED_VAR}={' '.join(sorted(built))!r})")
    return built[name].reference


def image_reference(name: str) -> str:
    return f"localhost/agentgym/{name}:{TAG}"


def podman_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CACHE / "containers.conf"))
    return env


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, env=podman_env(), check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


@dataclass
class Container:
    """A running container (`podman run -d`), removed on exit of `run_container`."""

    cid: str
    started: float = field(default_factory=time.monotonic)

    def address(self, port: int) -> str:
        """The host address a published container port answers on (host:port)."""
        return podman("port", self.cid, str(port)).stdout.strip().splitlines()[0]

    def url(self, port: int) -> str:
        return f"http://{self.address(port)}"

    def logs(self) -> str:
        result = podman("logs", self.cid, check=False)
        return result.stdout + result.stderr

    def running(self) -> bool:
        result = podman("inspect", "--format", "{{.State.Running}}", self.cid, check=False)
        return result.stdout.strip() == "true"

    def exit_code(self) -> int:
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", self.cid).stdout.strip())

    def stop(self, timeout: int = 20) -> int:
        """SIGTERM (as the kubelet sends), then the exit code."""
        podman("stop", "--time", str(timeout), self.cid, timeout=timeout + 30)
        return self.exit_code()

    def wait_http(self, url: str, deadline_s: float, expect: int = 200) -> tuple[httpx.Response, float]:
        """Poll `url` until it answers `expect`; returns the response and the seconds since start."""
        end = time.monotonic() + deadline_s
        last: str = ""
        while time.monotonic() < end:
            assert self.running(), f"the container exited ({self.exit_code()}):\n{self.logs()[-4000:]}"
            try:
                response = httpx.get(url, timeout=5)
                if response.status_code == expect:
                    return response, time.monotonic() - self.started
                last = f"{response.status_code} {response.text[:200]}"
            except httpx.HTTPError as error:
                last = repr(error)
            time.sleep(0.5)
        raise AssertionError(f"{url} did not answer {expect} in {deadline_s:.0f} s ({last}):\n{self.logs()[-4000:]}")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in a container's command."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def pod_run_args(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    host_volumes: Mapping[str, Path] | None = None,
) -> tuple[list[str], list[str]]:
    """`podman run` options and the command for a pod spec's container, as a kubelet would run it: the pod's
    user and group, the container's securityContext (read-only root, no capabilities, no privilege escalation),
    its env (`valueFrom` entries from `env`), workingDir, emptyDirs as tmpfs (a memory one on /dev/shm as
    --shm-size), and the other volumes (ConfigMaps, claims) as bind mounts of `host_volumes[name]`."""
    env = dict(env or {})
    host_volumes = dict(host_volumes or {})
    pod_security = pod.get("securityContext", {})
    security = container.get("securityContext", {})
    options: list[str] = []
    if "runAsUser" in pod_security:
        options += [
            "--user",
            f"{pod_security['runAsUser']}:{pod_security.get('runAsGroup', pod_security['runAsUser'])}",
        ]
    if "fsGroup" in pod_security:
        options += ["--group-add", str(pod_security["fsGroup"])]
    if security.get("readOnlyRootFilesystem"):
        options.append("--read-only")
    if "ALL" in security.get("capabilities", {}).get("drop", []):
        options.append("--cap-drop=ALL")
    if security.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    if container.get("workingDir"):
        options += ["--workdir", container["workingDir"]]
    values: dict[str, str] = {}
    for variable in container.get("env", []):
        if "value" in variable:
            values[variable["name"]] = str(variable["value"])
        elif variable["name"] in env:
            values[variable["name"]] = env[variable["name"]]
    values.update({k: v for k, v in env.items() if k not in values})
    for name, value in values.items():
        options += ["--env", f"{name}={value}"]
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        path = mount["mountPath"]
        if "emptyDir" in volume and path == "/dev/shm":
            size = str(volume["emptyDir"].get("sizeLimit", "64Mi")).replace("Gi", "g").replace("Mi", "m")
            options += ["--shm-size", size]
        elif "emptyDir" in volume:
            options += ["--tmpfs", f"{path}:rw,mode=1777,size=2g"]
        else:
            assert mount["name"] in host_volumes, f"no host folder for volume {mount['name']} ({volume})"
            mode = "ro" if mount.get("readOnly") else "rw"
            options += ["--volume", f"{host_volumes[mount['name']]}:{path}:{mode}"]
    command = [expand(part, values) for part in [*container.get("command", []), *container.get("args", [])]]
    return options, command


@contextmanager
def run_container(
    image: str,
    command: Sequence[str] = (),
    options: Sequence[str] = (),
    *,
    publish: Sequence[int] = (),
    network_host: bool = False,
    keep: bool = False,
) -> Iterator[Container]:
    """`podman run -d` with the command as the container's entrypoint (a pod's `command` replaces the image's
    ENTRYPOINT and CMD); `publish` container ports on 127.0.0.1 at free host ports."""
    args = ["run", "-d", "--pull=never", *options]
    if network_host:
        args += ["--network", "host"]
    for port in publish:
        args += ["--publish", f"127.0.0.1::{port}"]
    if command:
        args += ["--entrypoint", json.dumps(list(command))]
    args.append(image)
    cid = podman(*args).stdout.strip()
    container = Container(cid)
    try:
        yield container
    finally:
        if not keep:
            with suppress(AssertionError, subprocess.TimeoutExpired):
                podman("rm", "--force", "--time", "5", cid, timeout=60)


def run_once(image: str, command: Sequence[str], options: Sequence[str] = (), timeout: float = 300) -> tuple[int, str]:
    """Run a command in a container to its end; (exit code, stdout + stderr)."""
    args = ["run", "--rm", "--pull=never", *options]
    if command:
        args += ["--entrypoint", json.dumps(list(command))]
    result = podman(*args, image, timeout=timeout, check=False)
    return result.returncode, result.stdout + result.stderr


def host_tool(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} not on PATH"
    return found
