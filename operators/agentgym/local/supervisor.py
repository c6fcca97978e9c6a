"""Supervised local processes: started in order, health-checked, restarted when they crash, stopped cleanly.

Each start of a child gets its own scratch folder as `TMPDIR` (`agentgym-<name>-*` in this process's temporary
directory), removed once that child is seen to have exited, however it ended. What a killed child cannot clean
up itself (vLLM's ZMQ sockets and `vllm_dist_*` files, a killed Chromium's `org.chromium.Chromium.*`) goes with
it instead of piling up in /tmp over a long run's restarts. The folder's path stays short: Unix socket paths
are limited to 107 bytes, and vLLM puts 36-character socket names in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agentgym.children import die_with_parent
from agentgym.cpus import prefer_sleeping_omp_threads

log = logging.getLogger(__name__)


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    health_url: str | None = None
    ready_timeout_s: float = 120.0
    restart: bool = True
    max_restarts: int = 5
    # Exit code 0 means "finished" (the trainer at its last step), not a crash.
    done_on_success: bool = False
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ManagedProcess:
    spec: ProcessSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    scratch_dir: Path
    """This start's `TMPDIR`, removed when the process is seen to have exited (`Supervisor.reap`)."""
    restarts: int = 0
    finished: bool = False
    healthy: bool = False
    """Started and (where it has a health URL) answered it; False from a crash until it answers again."""
    recent_restarts: int = 0
    """Restarts since it last ran `RESTART_WINDOW_S` without crashing: what the restart budget counts, so a
    long run is not ended by crashes spread over hours (the kubelet resets its back-off the same way)."""


RESTART_WINDOW_S = 60.0


class ProcessFailedError(RuntimeError):
    pass


class Supervisor:
    """Runs `ProcessSpec`s with logs under `log_dir`, records restarts in `events_path` (JSON lines)."""

    def __init__(self, log_dir: Path, events_path: Path, on_event: Callable[[dict[str, object]], None] | None = None):
        self.log_dir = log_dir
        self.events_path = events_path
        self.on_event = on_event
        self.processes: dict[str, ManagedProcess] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def event(self, kind: str, name: str, **details: object) -> None:
        record: dict[str, object] = {"time": time.time(), "event": kind, "process": name, **details}
        with self.events_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.on_event:
            self.on_event(record)

    def _spawn(self, spec: ProcessSpec) -> tuple[subprocess.Popen[bytes], Path, Path]:
        log_path = self.log_dir / f"{spec.name}.log"
        handle = log_path.open("ab")
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        scratch_dir, scratch_environment = scratch_tmpdir(spec.name, environment)
        environment.update(scratch_environment)
        prefer_sleeping_omp_threads(environment)  # the run's processes share the machine's cores
        # A new session: Ctrl-C in the terminal reaches the runner only, which stops children in order.
        # The parent-death signal makes children exit even if the runner itself is killed.
        process = subprocess.Popen(
            spec.argv,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        handle.close()
        return process, log_path, scratch_dir

    @staticmethod
    def reap(managed: ManagedProcess) -> None:
        """Remove an exited process's scratch folder (idempotent; a live process keeps its own)."""
        if managed.process.poll() is not None:
            shutil.rmtree(managed.scratch_dir, ignore_errors=True)

    async def start(self, spec: ProcessSpec) -> ManagedProcess:
        process, log_path, scratch_dir = self._spawn(spec)
        managed = ManagedProcess(spec, process, log_path, started_at=time.time(), scratch_dir=scratch_dir)
        self.processes[spec.name] = managed
        self.event("started", spec.name, pid=process.pid)
        await self.wait_healthy(managed)
        managed.healthy = True
        return managed

    async def wait_healthy(self, managed: ManagedProcess) -> None:
        spec = managed.spec
        if spec.health_url is None:
            return
        deadline = time.monotonic() + spec.ready_timeout_s
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                if managed.process.poll() is not None:
                    raise ProcessFailedError(
                        f"{spec.name} exited with code {managed.process.returncode} while starting; "
                        f"last log lines:\n{tail(managed.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(spec.health_url)).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ProcessFailedError(f"{spec.name} not healthy within {spec.ready_timeout_s:.0f}s")
                await asyncio.sleep(0.2)

    async def watch(self, stop: asyncio.Event, poll_s: float = 0.5) -> None:
        """Restart crashed processes until `stop`; raises ProcessFailedError past a process's restart budget."""
        while not stop.is_set():
            for managed in list(self.processes.values()):
                code = managed.process.poll()
                if code is None or managed.finished:
                    continue
                spec = managed.spec
                self.reap(managed)
                if code == 0 and spec.done_on_success:
                    managed.finished = True
                    self.event("finished", spec.name)
                    continue
                managed.healthy = False
                self.event("crashed", spec.name, exit_code=code, restarts=managed.restarts)
                log.warning("%s exited with code %s; last log lines:\n%s", spec.name, code, tail(managed.log_path))
                if time.time() - managed.started_at > RESTART_WINDOW_S:
                    managed.recent_restarts = 0
                if not spec.restart or managed.recent_restarts >= spec.max_restarts:
                    raise ProcessFailedError(f"{spec.name} exited with code {code} (restarts: {managed.restarts})")
                await asyncio.sleep(min(2**managed.recent_restarts, 10))
                managed.process, managed.log_path, managed.scratch_dir = self._spawn(spec)
                managed.restarts += 1
                managed.recent_restarts += 1
                managed.started_at = time.time()
                self.event("restarted", spec.name, pid=managed.process.pid, restarts=managed.restarts)
                await self.wait_healthy(managed)
                managed.healthy = True
                self.event("healthy", spec.name, restarts=managed.restarts)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)

    def finished(self, name: str) -> bool:
        managed = self.processes.get(name)
        return managed is not None and managed.finished

    def stop_all(self, order: list[str] | None = None, timeout_s: float = 30.0) -> None:
        """SIGTERM in `order` (default: reverse start order), wait, then SIGKILL what is left; every scratch
        folder goes with its process."""
        names = order or list(reversed(self.processes))
        for name in names:
            managed = self.processes.get(name)
            if managed is None or managed.process.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                managed.process.send_signal(signal.SIGTERM)
            try:
                managed.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                managed.process.kill()
                managed.process.wait()
                self.event("killed", name)
            else:
                self.event("stopped", name, exit_code=managed.process.returncode)
        for managed in self.processes.values():
            self.reap(managed)


def scratch_tmpdir(name: str, environment: Mapping[str, str]) -> tuple[Path, dict[str, str]]:
    """A new scratch folder for a child called `name` (`agentgym-<name>-*` in this process's temporary directory),
    and the entries that make it the child's `TMPDIR` in its `environment`: for the supervisor's children, and for
    servers that tests and benchmarks start alone. The caller removes the folder once the child has exited.

    Caches that live in the temporary directory by default keep their place across the child's starts unless
    `environment` sets them: torch inductor's compiled kernels (vLLM's CPU backend compiles a few outside its own
    cache; seconds a start)."""
    folder = Path(tempfile.mkdtemp(prefix=f"agentgym-{name}-"))
    entries = {"TMPDIR": str(folder)}
    if "TORCHINDUCTOR_CACHE_DIR" not in environment:
        entries["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    return folder, entries


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
