"""One ScienceWorld simulator in its own JVM, driven over py4j, with a capped heap.

The `scienceworld` wheel's `ScienceWorldEnv` starts its JVM with Java's default heap (a quarter of
the machine's memory) and, on every `step`, converts the full valid-action list element by element
over py4j (hundreds of socket round trips). This module launches the wheel's bundled jar itself, so
that it can choose the JVM's options, and exposes the simulator's calls one by one so the caller
pays only for what it uses.

JVM options (see `JVMSettings.java_options`):

* ``-Xmx<heap_mb>m`` caps the heap (default 768 MB); ``-XX:+ExitOnOutOfMemoryError`` makes a JVM
  that runs out of it exit (code 3) instead of limping on, so the pool replaces it;
* the serial collector (one simulator thread: no parallel GC threads, smallest footprint), a small
  initial heap that grows on demand and gives memory back after collections;
* an application class-data-sharing archive (AppCDS) of ScienceWorld's classes when one exists:
  class loading is most of a JVM's start-up, and the archive's pages are shared by every JVM on the
  machine. `build_cds_archive` writes it (the image does so at build time; a pool does it once in
  the background when it is missing). A stale or foreign archive is ignored by the JVM itself.

glibc's malloc arenas are limited to two (``MALLOC_ARENA_MAX``) so the JIT's short-lived native
allocations do not leave the process's resident size creeping up over thousands of episodes.

The simulator prints debugging text on stdout on every step; its `System.out` is pointed at a null
stream once the gateway is up, so nothing is piped back and parsed for nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from py4j.java_gateway import GatewayParameters, JavaGateway, find_jar_path
from py4j.protocol import Py4JError, Py4JJavaError
from scienceworld.constants import BASEPATH, JAR_PATH

log = logging.getLogger(__name__)

DEFAULT_HEAP_MB = 768
MIN_HEAP_MB = 128
# The separator for lists fetched in one call: it never occurs inside an action or object name.
_SEPARATOR = "\n"
# A world loaded and stepped once when a JVM starts, so its classes are loaded and warm.
WARM_UP_TASK = ("boil", 0)
# Tasks exercised when building the class-data-sharing archive (diverse object and action classes).
_CDS_TRAINING_TASKS = (
    ("boil", 0),
    ("power-component", 0),
    ("chemistry-mix", 0),
    ("grow-plant", 0),
    ("find-living-thing", 0),
    ("inclined-plane-determine-angle", 0),
)


class JVMError(RuntimeError):
    """A ScienceWorld JVM could not start, or died."""


class JVMDiedError(JVMError):
    """The JVM behind a slot is gone (killed, crashed, out of memory) or stopped answering."""


@dataclass(frozen=True)
class JVMSettings:
    """How to launch a ScienceWorld JVM. Hashable: pools are shared per distinct settings."""

    heap_mb: int = DEFAULT_HEAP_MB
    java: str | None = None  # the java executable; default: $JAVA_HOME/bin/java, else `java` on PATH
    java_options: tuple[str, ...] = ()  # extra JVM options, after the defaults (so they can override)
    cds: str = "auto"  # "auto": use (and build once) the archive in the cache; "off"; or a .jsa path
    startup_timeout_s: float = 120.0
    call_timeout_s: float = 300.0  # a single simulator call longer than this counts as a hung JVM

    def __post_init__(self) -> None:
        if self.heap_mb < MIN_HEAP_MB:
            raise ValueError(f"heap_mb must be at least {MIN_HEAP_MB} (ScienceWorld needs it), not {self.heap_mb}")
        if self.startup_timeout_s <= 0 or self.call_timeout_s <= 0:
            raise ValueError("startup_timeout_s and call_timeout_s must be positive")
        if not self.cds:
            raise ValueError('cds must be "auto", "off" or the path of a .jsa archive')

    def java_executable(self) -> str:
        if self.java:
            return self.java
        home = os.environ.get("JAVA_HOME")
        if home and os.path.exists(os.path.join(home, "bin", "java")):
            return os.path.join(home, "bin", "java")
        found = shutil.which("java")
        if found is None:
            raise JVMError("no `java` on PATH and no JAVA_HOME: ScienceWorld needs a Java 17+ runtime")
        return found

    def base_options(self) -> list[str]:
        """The JVM options every ScienceWorld JVM gets (without the class-data-sharing ones)."""
        initial = min(64, self.heap_mb)
        return [
            f"-Xmx{self.heap_mb}m",
            f"-Xms{initial}m",
            "-XX:+UseSerialGC",
            "-XX:MinHeapFreeRatio=10",
            "-XX:MaxHeapFreeRatio=30",
            "-XX:+ExitOnOutOfMemoryError",
            "-XX:-UsePerfData",
            "-Djava.awt.headless=true",
            "-Xshare:auto",
        ]

    def archive_path(self) -> Path | None:
        """The class-data-sharing archive these settings use, or None when it is off."""
        if self.cds == "off":
            return None
        if self.cds != "auto":
            return Path(self.cds)
        return default_archive_path(self.java_executable())


def classpath() -> str:
    return os.pathsep.join((find_jar_path(), JAR_PATH))


@lru_cache(maxsize=8)
def _java_fingerprint(java: str) -> str:
    """The java build's identity (an archive only fits the JVM build and jar that wrote it)."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, check=False)
        version = out.stderr + out.stdout
    except OSError as error:
        raise JVMError(f"cannot run {java}: {error}") from error
    return f"{os.path.realpath(java)}\n{version}"


def default_archive_path(java: str) -> Path:
    """Where the archive for this java build and this jar lives in the cache directory."""
    jar = Path(JAR_PATH).stat()
    key = hashlib.sha256(f"{_java_fingerprint(java)}\n{JAR_PATH}\n{jar.st_size}\n{jar.st_mtime_ns}".encode())
    root = os.environ.get("AGENTGYM_SCIWORLD_CDS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "agentgym", "sciworld"
    )
    return Path(root) / f"scienceworld-{key.hexdigest()[:16]}.jsa"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 3:
        return "exit code 3: out of heap memory"
    return f"exit code {code}"


class _Drain(threading.Thread):
    """Reads a child's pipe to the end, keeping the last lines (for error reports)."""

    def __init__(self, stream: IO[bytes], keep: int, lines: queue.Queue[str] | None = None) -> None:
        super().__init__(daemon=True, name="sciworld-jvm-pipe")
        self.stream = stream
        self.tail: deque[str] = deque(maxlen=keep)
        self.lines = lines

    def run(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in iter(self.stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip()
                self.tail.append(line)
                if self.lines is not None:
                    self.lines.put(line)
        if self.lines is not None:
            self.lines.put("")  # EOF


class ScienceWorldJVM:
    """A JVM running ScienceWorld and one simulator (`PythonInterface`) inside it.

    Not thread-safe: one caller at a time (the pool leases it to one episode).
    """

    def __init__(self, settings: JVMSettings, *, archive: Path | None = None, dump_archive: Path | None = None):
        """Start the JVM and the simulator. `archive`: use this CDS archive; `dump_archive`: write one at exit."""
        self.settings = settings
        self.started_at = time.monotonic()
        options = settings.base_options()
        if dump_archive is not None:
            options.append(f"-XX:ArchiveClassesAtExit={dump_archive}")
        elif archive is not None:
            options.append(f"-XX:SharedArchiveFile={archive}")
        self.archive = archive if dump_archive is None else None
        options.extend(settings.java_options)
        self.command = [settings.java_executable(), "-cp", classpath(), *options, "py4j.GatewayServer"]
        self.command += ["--die-on-broken-pipe", "0"]  # exits when our end of its stdin closes
        try:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=BASEPATH,
                env={**os.environ, "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")},
                start_new_session=True,  # a terminal's Ctrl-C goes to the service, which closes its JVMs
            )
        except OSError as error:
            raise JVMError(f"cannot start {self.command[0]}: {error}") from error
        assert self.process.stdout is not None and self.process.stderr is not None
        self._stderr = _Drain(self.process.stderr, keep=40)
        self._stderr.start()
        lines: queue.Queue[str] = queue.Queue()
        self._stdout = _Drain(self.process.stdout, keep=5, lines=lines)
        self._stdout.start()
        self._gateway: JavaGateway | None = None
        try:
            port = self._read_port(lines, settings.startup_timeout_s)
            self._gateway = JavaGateway(
                gateway_parameters=GatewayParameters(port=port, read_timeout=settings.call_timeout_s),
                java_process=self.process,
            )
            jvm: Any = self._gateway.jvm
            jvm.java.lang.System.setOut(jvm.java.io.PrintStream(jvm.java.io.OutputStream.nullOutputStream()))
            self.server: Any = jvm.scienceworld.runtime.pythonapi.PythonInterface()
            self._string: Any = jvm.java.lang.String
        except Exception as error:
            reason = self.failure_reason() if self.process.poll() is not None else str(error)
            self.kill()
            raise JVMError(f"ScienceWorld JVM failed to start: {reason}") from error
        self.pid = self.process.pid

    def _read_port(self, lines: queue.Queue[str], timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JVMError(f"no gateway port within {timeout:g}s")
            try:
                line = lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line.strip().isdigit():
                self._stdout.lines = None  # from here on, only keep a tail
                return int(line.strip())
            if line == "":
                # EOF on stdout: the JVM is exiting. The pipe can close a moment before the process
                # is reaped, so wait for the exit instead of trusting poll() right now.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=10)
                if self.process.poll() is not None:
                    raise JVMError(self.failure_reason())
                raise JVMError("the JVM closed its output without printing a gateway port")

    # -- health ----------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.process.poll() is None

    def failure_reason(self) -> str:
        """Why the JVM is gone (exit status and the last lines it wrote on stderr)."""
        code = self.process.poll()
        tail = " | ".join(line for line in list(self._stderr.tail)[-6:] if line.strip())
        text = f"ScienceWorld JVM (pid {self.process.pid}) {'died' if code is not None else 'stopped answering'}"
        text += f" ({_describe_exit(code)})"
        return f"{text}: {tail}" if tail else text

    def rss_bytes(self) -> int | None:
        """Resident memory of the JVM process (Linux), None where unknown."""
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def max_heap_bytes(self) -> int:
        """The JVM's own view of its heap cap (Runtime.maxMemory)."""
        with self._guard():
            return int(self._jvm().java.lang.Runtime.getRuntime().maxMemory())

    def input_arguments(self) -> list[str]:
        """The options the JVM was started with, as the JVM reports them."""
        with self._guard():
            bean = self._jvm().java.lang.management.ManagementFactory.getRuntimeMXBean()
            arguments = bean.getInputArguments()
        return self._strings(arguments)

    def _jvm(self) -> Any:
        if self._gateway is None:
            raise JVMDiedError("the JVM is closed")
        return self._gateway.jvm

    # -- simulator calls -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn py4j's errors of a dead or hung JVM into JVMDiedError with the reason."""
        try:
            yield
        except Py4JJavaError:
            raise  # an exception inside the simulator: the JVM itself is fine
        except Py4JError as error:  # the connection broke: the JVM died, or is dying
            raise self._died(error) from error

    def call(self, name: str, *args: Any) -> Any:
        """Call a PythonInterface method (a dead or hung JVM raises JVMDiedError with the reason)."""
        with self._guard():
            return getattr(self.server, name)(*args)

    def _died(self, error: BaseException) -> JVMDiedError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=2)  # a killed JVM drops its sockets a moment before it is reaped
        if self.alive():  # it answers no more (read timeout or a broken connection): it is useless
            reason = f"ScienceWorld JVM (pid {self.process.pid}) stopped answering: {error}"
            self.kill()
            return JVMDiedError(reason)
        return JVMDiedError(self.failure_reason())

    def _strings(self, java_list: Any) -> list[str]:
        """A java.util.List of strings in one round trip (py4j would fetch it element by element)."""
        with self._guard():
            joined: str = self._string.join(_SEPARATOR, java_list)
        return joined.split(_SEPARATOR) if joined else []

    def load(self, task_name: str, variation: int, gold_path: bool = False) -> None:
        error: str = self.call("load", task_name, variation, "", gold_path)
        if error:
            raise ValueError(f"ScienceWorld could not load {task_name} variation {variation}: {error}")

    def step(self, action: str) -> tuple[str, float, bool, int]:
        """The raw step: (observation, score in 0-1 or -1 on failure, completed, moves)."""
        observation: str = self.call("step", action)
        return observation, float(self.call("getScore")), bool(self.call("getCompleted")), int(self.call("getNumMoves"))

    def task_description(self) -> str:
        return str(self.call("getTaskDescription"))

    def look(self) -> str:
        return str(self.call("freeActionLook"))

    def inventory(self) -> str:
        return str(self.call("freeActionInventory"))

    def goal_progress(self) -> str:
        return str(self.call("getGoalProgressStr"))

    def valid_actions(self) -> list[str]:
        return self._list_call("getValidActionObjectCombinations")

    def possible_actions(self) -> list[str]:
        return self._list_call("getPossibleActions")

    def possible_objects(self) -> list[str]:
        return self._list_call("getPossibleObjects")

    def gold_actions(self) -> list[str]:
        return self._list_call("getGoldActionSequence")

    def variations(self) -> tuple[list[int], list[int], list[int]]:
        """ScienceWorld's train/dev/test variation indices of the loaded task."""
        return self._ints("getVariationsTrain"), self._ints("getVariationsDev"), self._ints("getVariationsTest")

    def _ints(self, name: str) -> list[int]:
        """A java.util.List of integers in one round trip (its toString is ``[1, 2, 3]``)."""
        java_list = self.call(name)
        with self._guard():
            text: str = java_list.toString()
        inner = text.strip().removeprefix("[").removesuffix("]").strip()
        return [int(item) for item in inner.split(",")] if inner else []

    def max_variations(self, task_name: str) -> int:
        return int(self.call("getTaskMaxVariations", task_name))

    def task_names(self) -> list[str]:
        return self._list_call("getTaskNames")

    def _list_call(self, name: str) -> list[str]:
        return self._strings(self.call(name))

    def warm_up(self) -> None:
        """Load and step one small world so the classes the simulator needs are loaded and compiled."""
        self.load(*WARM_UP_TASK)
        self.step("look around")

    # -- shutdown --------------------------------------------------------------------------------

    def kill(self) -> None:
        """Stop at once (SIGKILL), for a JVM that is broken or busy in a call that will never be answered."""
        with contextlib.suppress(OSError):
            self.process.kill()
        self._disconnect()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self._close_pipes()

    def close(self, timeout: float = 5.0) -> None:
        """Orderly exit (closing its stdin makes the gateway call System.exit), then kill if it lingers."""
        self._disconnect()
        if self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.process.stdin is not None
                self.process.stdin.close()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=10)
        self._close_pipes()

    def _disconnect(self) -> None:
        gateway, self._gateway = self._gateway, None
        if gateway is not None:
            with contextlib.suppress(Exception):
                gateway.close(keep_callback_server=False, close_callback_server_connections=False)
            # py4j keeps trying to tell a closed JVM about Python objects it garbage-collects
            # (and logs an error for each); a disconnected client skips that.
            gateway._gateway_client.is_connected = False

    def _close_pipes(self) -> None:
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.close()


_ARCHIVE_LOCK = threading.Lock()


def build_cds_archive(
    settings: JVMSettings, path: Path | None = None, tasks: Iterable[tuple[str, int]] = _CDS_TRAINING_TASKS
) -> Path:
    """Write the class-data-sharing archive for these settings (atomically; a no-op when present).

    A JVM is started with ``-XX:ArchiveClassesAtExit``, made to load and step a few worlds, and shut
    down in order; the JVM writes the classes it loaded into the archive as it exits.
    """
    target = path or settings.archive_path()
    if target is None:
        raise ValueError("class-data sharing is off in these settings")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _ARCHIVE_LOCK:
        if target.exists():
            return target
        for stale in target.parent.glob("*.jsa.*.tmp"):  # left by builds whose process died
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > 3600:
                    stale.unlink()
        fd, temporary = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        os.close(fd)
        os.unlink(temporary)  # the JVM creates the file itself
        try:
            jvm = ScienceWorldJVM(settings, dump_archive=Path(temporary))
            try:
                for task_name, variation in tasks:
                    jvm.load(task_name, variation)
                    jvm.step("look around")
                    jvm.valid_actions()
                    jvm.step("open door to kitchen")
                    jvm.inventory()
            finally:
                jvm.close(timeout=120)  # the archive is written during the orderly exit
            if not os.path.exists(temporary) or os.path.getsize(temporary) == 0:
                raise JVMError(f"the JVM wrote no class-data archive ({jvm.failure_reason()})")
            os.replace(temporary, target)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    log.info("wrote ScienceWorld class-data archive %s", target)
    return target


def usable_archive(settings: JVMSettings) -> Path | None:
    """The archive to start JVMs with, when it exists (None otherwise or when sharing is off)."""
    try:
        path = settings.archive_path()
    except JVMError:
        return None
    return path if path is not None and path.is_file() else None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agentgym.envs.sciworld.jvm [HEAP_MB]`: build the class-data archive (image build step)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    settings = JVMSettings(heap_mb=int(args[0])) if args else JVMSettings()
    started = time.perf_counter()
    path = build_cds_archive(settings)
    print(f"class-data archive: {path} ({path.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
