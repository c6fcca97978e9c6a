"""ScienceWorld simulators in JVMs launched by us, driven over py4j, with a capped heap.

The `scienceworld` wheel's `ScienceWorldEnv` starts its JVM with Java's default heap (a quarter of
the machine's memory) and, on every `step`, converts the full valid-action list element by element
over py4j (hundreds of socket round trips). This module launches the wheel's bundled jar itself, so
that it can choose the JVM's options, and exposes the simulator's calls one by one so the caller
pays only for what it uses.

One JVM hosts one or more simulators (`Simulator`, one ScienceWorld ``PythonInterface`` object
each, up to the JVM's `capacity`): a JVM costs ~1.3 CPU-seconds and ~100 MB to start, an extra
simulator in a warm JVM a few milliseconds (made without its constructor, which builds
ScienceWorld's whole task table, ~17,600 objects: see `_InterfaceCloner`) and ~10-30 MB.
Simulators of one JVM are separate worlds, but ScienceWorld keeps some of a world's state in
JVM-wide singletons, so the JVM makes them safe to share:

* every simulator call holds the JVM's lock: one call at a time per JVM. The singletons (object
  counter, random generator, type-id table) are unsynchronised; concurrent calls could give two
  objects one id, corrupt the table, or draw from the generator while another world is laid out.
  A JVM's step throughput is therefore one core's, shared by its simulators (a step takes
  milliseconds, an agent's turn seconds);
* when a call of another simulator comes next, the object counter and the random generator are
  swapped for that simulator's own (`_SharedState`), so each simulator sees what it would see in
  a JVM of its own. A JVM with capacity 1 swaps nothing.

What they do share is fate: a JVM that dies takes all its simulators with it.

JVM options (see `JVMSettings.base_options`):

* ``-Xmx`` caps the heap: `heap_mb` (default 768 MB) per simulator the JVM hosts, so a pool's total
  cap is its size x `heap_mb` however the simulators are packed; ``-XX:+ExitOnOutOfMemoryError``
  makes a JVM that runs out of it exit (code 3) instead of limping on, so the pool replaces it;
* the serial collector (simulator calls are serialised: no parallel GC threads, smallest
  footprint), an initial heap that grows on demand and gives memory back after collections (64 MB
  plus 16 MB per extra simulator it may host: starting 8 simulators from 64 MB took 11 full
  collections, ~1.2 s; from 176 MB, 7 young ones);
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from py4j.java_gateway import GatewayParameters, JavaClass, JavaGateway, find_jar_path
from py4j.protocol import Py4JError, Py4JJavaError
from scienceworld.constants import BASEPATH, JAR_PATH

log = logging.getLogger(__name__)

DEFAULT_HEAP_MB = 768
MIN_HEAP_MB = 128
# The separator for lists fetched in one call: it never occurs inside an action or object name.
_SEPARATOR = "\n"
# A world loaded and stepped once when a JVM starts, so its classes are loaded and warm.
WARM_UP_TASK = ("boil", 0)
# Initial heap of a JVM: 64 MB, and 16 MB more per extra simulator it is to host.
_INITIAL_HEAP_MB = 64
_INITIAL_HEAP_PER_EXTRA_MB = 16
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

    heap_mb: int = DEFAULT_HEAP_MB  # heap cap per simulator; a JVM gets this times its capacity
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

    def max_heap_mb(self, capacity: int = 1) -> int:
        """The heap cap of a JVM hosting up to `capacity` simulators."""
        return self.heap_mb * max(1, capacity)

    def base_options(self, capacity: int = 1) -> list[str]:
        """The JVM options of a JVM for `capacity` simulators (without the class-data-sharing ones)."""
        cap = self.max_heap_mb(capacity)
        # A warm simulator holds ~10 MB of live heap; starting one allocates several times that.
        initial = min(_INITIAL_HEAP_MB + _INITIAL_HEAP_PER_EXTRA_MB * (max(1, capacity) - 1), cap)
        return [
            f"-Xmx{cap}m",
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

    def __init__(
        self,
        stream: IO[bytes],
        keep: int,
        lines: queue.Queue[str] | None = None,
        at_eof: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(daemon=True, name="sciworld-jvm-pipe")
        self.stream = stream
        self.tail: deque[str] = deque(maxlen=keep)
        self.lines = lines
        self.at_eof = at_eof

    def run(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in iter(self.stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip()
                self.tail.append(line)
                if self.lines is not None:
                    self.lines.put(line)
        if self.lines is not None:
            self.lines.put("")  # EOF
        if self.at_eof is not None:
            self.at_eof()


class ScienceWorldJVM:
    """A JVM running ScienceWorld, hosting up to `capacity` simulators (`add_simulator`).

    Thread-safe: simulator calls from any thread are serialised by the JVM's lock (see the module
    docstring for why); each simulator is driven by one caller at a time (the pool leases it to one
    episode).
    """

    def __init__(
        self,
        settings: JVMSettings,
        *,
        capacity: int = 1,
        archive: Path | None = None,
        dump_archive: Path | None = None,
    ):
        """Start the JVM (no simulator yet). `archive`: use this CDS archive; `dump_archive`: write one at exit."""
        if capacity < 1:
            raise ValueError(f"a JVM hosts at least one simulator, not {capacity}")
        self.settings = settings
        self.capacity = capacity
        self.started_at = time.monotonic()
        self.simulators: list[Simulator] = []
        self._lock = threading.Lock()  # held for every simulator call: one at a time per JVM
        self._shared_state: _SharedState | None = None  # swapped between simulators (capacity > 1)
        self._active: Simulator | None = None  # the simulator whose state the JVM's singletons hold
        self._task_table: Any = None  # the first simulator's task table, before its first load
        self._cloner: _InterfaceCloner | None = None  # makes later simulators like the first (capacity > 1)
        self._exit_lock = threading.Lock()
        self._exit_callbacks: list[Callable[[ScienceWorldJVM], None]] | None = []  # None once exited
        options = settings.base_options(capacity)
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
        self.pid = self.process.pid
        assert self.process.stdout is not None and self.process.stderr is not None
        self._stderr = _Drain(self.process.stderr, keep=40)
        self._stderr.start()
        lines: queue.Queue[str] = queue.Queue()
        # stdout reaches its end only when the process exits: that is when the exit callbacks run.
        self._stdout = _Drain(self.process.stdout, keep=5, lines=lines, at_eof=self._exited)
        self._stdout.start()
        self._gateway: JavaGateway | None = None
        try:
            port = self._read_port(lines, settings.startup_timeout_s)
            self._gateway = JavaGateway(
                gateway_parameters=GatewayParameters(port=port, read_timeout=settings.call_timeout_s),
                java_process=self.process,
            )
            client = self._gateway._gateway_client
            null_stream = _java_class(client, "java.io.OutputStream").nullOutputStream()
            _java_class(client, "java.lang.System").setOut(_java_class(client, "java.io.PrintStream")(null_stream))
            # Looked up once: py4j resolves `jvm.a.b.C` one round trip per dot, and a static member
            # of a class one more round trip on every access.
            self._join: Any = _java_class(client, "java.lang.String").join
            self._interface_class: Any = _java_class(client, "scienceworld.runtime.pythonapi.PythonInterface")
            if capacity > 1:
                self._shared_state = _SharedState(client)
        except Exception as error:
            reason = self.failure_reason() if self.process.poll() is not None else str(error)
            self.kill()
            raise JVMError(f"ScienceWorld JVM failed to start: {reason}") from error

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

    # -- simulators ------------------------------------------------------------------------------

    def add_simulator(self) -> Simulator:
        """Create one more simulator in this JVM (a few ms once it has one: see `_construct`)."""
        with self._lock:
            if len(self.simulators) >= self.capacity:
                raise JVMError(f"this JVM already hosts its {self.capacity} simulator(s)")
            simulator = Simulator(self, index=len(self.simulators))
            self.simulators.append(simulator)  # its place, so that concurrent additions respect the capacity
        try:
            self._construct(simulator)
        except BaseException:
            with self._lock:
                self.simulators.remove(simulator)
            raise
        return simulator

    def _construct(self, simulator: Simulator) -> None:
        with self.exclusive(simulator):  # its construction draws ids and random numbers: its own
            self._jvm()  # raises JVMDiedError once the JVM is closed
            if self._shared_state is None:  # a JVM of one simulator
                simulator._server = self._interface_class()
                return
            # ScienceWorld's constructor builds the whole task table (~12 MB, ~45 ms in a warm JVM;
            # it has no constructor or factory that takes one), and every load builds a new one: the
            # table's objects become the loaded world, so a table serves one load only. Until its
            # first load a simulator only reads task names and variation counts from it, the same
            # for all. So the JVM's later simulators are made without the constructor, sharing the
            # first one's table (`_InterfaceCloner`): ~3 ms each instead of ~45 ms, and a slot never
            # loaded holds ~6 MB less. Where that cannot be done, they are constructed and pointed
            # at the first table, which frees theirs at once.
            if self._cloner is not None:
                simulator._server = self._cloner.make()
                return
            server = self._interface_class()
            simulator._server = server
            if self._task_table is None:
                self._task_table = server.taskMaker()
                assert self._gateway is not None
                self._cloner = _InterfaceCloner.of(self._gateway, server)
            else:
                getattr(server, "taskMaker_$eq")(self._task_table)

    @contextlib.contextmanager
    def exclusive(self, simulator: Simulator | None = None) -> Iterator[None]:
        """Hold the JVM for one operation of `simulator` (its calls run alone, on its own state).

        py4j's errors of a dead or hung JVM become JVMDiedError with the reason. A call waits for
        the lock at most twice the call timeout: the call holding it has had its own timeout by
        then (which kills a JVM that stopped answering), so a JVM still held is hung.
        """
        if not self._lock.acquire(timeout=2 * self.settings.call_timeout_s):
            reason = f"ScienceWorld JVM (pid {self.pid}) stopped answering: a call has held it for too long"
            self.kill()
            raise JVMDiedError(reason)
        try:
            with self._guard():
                if simulator is not None and simulator is not self._active and self._shared_state is not None:
                    self._shared_state.switch(self._active, simulator)
                    self._active = simulator
                yield
        finally:
            self._lock.release()

    # -- health ----------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.process.poll() is None

    def failure_reason(self) -> str:
        """Why the JVM is gone (exit status and the last lines it wrote on stderr)."""
        code = self.process.poll()
        if code is not None and self._stderr is not threading.current_thread():
            # The exit may be seen (on stdout, or by poll) before the stderr thread has read the
            # JVM's last words; they are what says why, so wait briefly for that pipe's end.
            self._stderr.join(timeout=5)
        tail = " | ".join(line for line in list(self._stderr.tail)[-6:] if line.strip())
        text = f"ScienceWorld JVM (pid {self.process.pid}) {'died' if code is not None else 'stopped answering'}"
        text += f" ({_describe_exit(code)})"
        return f"{text}: {tail}" if tail else text

    def on_exit(self, callback: Callable[[ScienceWorldJVM], None]) -> None:
        """Call `callback(self)` once the process has exited (at once if it already has), from a pipe thread."""
        with self._exit_lock:
            if self._exit_callbacks is not None:
                self._exit_callbacks.append(callback)
                return
        callback(self)

    def _exited(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            # Timed: a timed wait polls and never holds Popen's wait lock, so poll() elsewhere stays exact.
            self.process.wait(timeout=60)
        with self._exit_lock:
            callbacks, self._exit_callbacks = self._exit_callbacks or [], None
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("a ScienceWorld JVM exit callback failed")

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
            raise JVMDiedError(self.failure_reason() if not self.alive() else "the JVM is closed")
        return self._gateway.jvm

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn py4j's errors of a dead or hung JVM into JVMDiedError with the reason."""
        try:
            yield
        except Py4JJavaError:
            raise  # an exception inside the simulator: the JVM itself is fine
        except Py4JError as error:  # the connection broke: the JVM died, or is dying
            raise self._died(error) from error

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
        joined: str = self._join(_SEPARATOR, java_list)
        return joined.split(_SEPARATOR) if joined else []

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


def _java_class(client: Any, name: str) -> Any:
    """The py4j handle of Java class `name`, made without asking the JVM (`jvm.a.b.C` asks once per dot)."""
    return JavaClass(name, client)


def _scala_object(client: Any, name: str) -> Any:
    """A Scala `object` (the singleton instance of class ``name$``)."""
    return _java_class(client, "java.lang.Class").forName(f"{name}$").getField("MODULE$").get(None)


class _InterfaceCloner:
    """Makes ``PythonInterface`` objects as its constructor would, without building a task table.

    The constructor sets 15 fields. From a freshly constructed template (never loaded) this copies
    the values that are immutable (strings, ``None``, an empty array) and the task table (read-only
    until a load replaces it), and makes anew the two objects a simulator changes in place: its
    action handler (``ActionDefinitions.mkActionDefinitions()``, as the constructor calls it) and
    its run history (``RunHistory("", -1, -1)`` with the class's default arguments). Fields the
    constructor sets to 0/false are left as allocation leaves them. Every field a load or step
    uses is set by the load itself (``doLoad``), before the simulator does anything else.

    The object is allocated by ``sun.misc.Unsafe.allocateInstance`` and its fields set by
    reflection (~13 round trips). `of` checks the class has exactly the fields this knows, so a
    different ScienceWorld is constructed normally instead of being half-initialised.
    """

    FIELDS = frozenset(
        {
            "ERROR_MESSAGE_UNINITIALIZED",
            "agentInterface",
            "agent",
            "actionHandler",
            "taskStr",
            "taskVariationIdx",
            "simplificationStr",
            "goldActionsStr",
            "goldPathGenerationEnabled",
            "score",
            "isComplete",
            "errorUnknownEnvironment",
            "errorStr",
            "taskMaker",
            "currentHistory",
        }
    )
    _MADE_ANEW = frozenset({"actionHandler", "currentHistory"})

    def __init__(self, gateway: JavaGateway, template: Any) -> None:
        client = gateway._gateway_client
        java_class = _java_class(client, "java.lang.Class")
        modifier = _java_class(client, "java.lang.reflect.Modifier")
        unsafe_field = java_class.forName("sun.misc.Unsafe").getDeclaredField("theUnsafe")
        unsafe_field.setAccessible(True)
        self._unsafe = unsafe_field.get(None)
        self._class = java_class.forName("scienceworld.runtime.pythonapi.PythonInterface")
        fields = {}
        for field in self._class.getDeclaredFields():
            if not modifier.isStatic(field.getModifiers()):
                fields[str(field.getName())] = field
        if set(fields) != self.FIELDS:
            raise ValueError(f"PythonInterface has fields {sorted(fields)}, not the ones known")
        self._copied: list[tuple[Any, Any]] = []  # (field, the template's value)
        for name, field in fields.items():
            field.setAccessible(True)  # private (two final): set the way deserialisation does
            if name in self._MADE_ANEW:
                continue
            value = field.get(template)
            if not (isinstance(value, bool | int | float) and not value):  # zeroes: as allocated
                self._copied.append((field, value))
        self._action_handler_field = fields["actionHandler"]
        self._history_field = fields["currentHistory"]
        self._action_definitions = _scala_object(client, "scienceworld.input.ActionDefinitions")
        self._run_history = _java_class(client, "scienceworld.goldagent.RunHistory")
        companion = _scala_object(client, "scienceworld.goldagent.RunHistory")
        self._history_defaults = [getattr(companion, f"$lessinit$greater$default${i}")() for i in (4, 5, 6)]

    @classmethod
    def of(cls, gateway: JavaGateway, template: Any) -> _InterfaceCloner | None:
        """A cloner of `template`, or None (logged) where this JVM or ScienceWorld does not allow it."""
        try:
            cloner = cls(gateway, template)
            cloner.make()  # once here, so a JVM that refuses fails now rather than at every addition
            return cloner
        except (Py4JError, ValueError) as error:
            log.warning("ScienceWorld simulators of a JVM will each build a task table: %s", error)
            return None

    def make(self) -> Any:
        """A new PythonInterface in the state its constructor leaves, sharing the template's task table."""
        server = self._unsafe.allocateInstance(self._class)
        for field, value in self._copied:
            field.set(server, value)
        self._action_handler_field.set(server, self._action_definitions.mkActionDefinitions())
        self._history_field.set(server, self._run_history("", -1, -1, *self._history_defaults))
        return server


class _SharedState:
    """ScienceWorld's per-world state that lives in JVM-wide singletons, swapped per simulator.

    * the object counter (``util.UniqueIdentifier.count``): every load resets it to 0 and numbers
      the new world's objects from there; objects made later (steam, mixtures, seeds) take the
      next ids. Ids are object equality (``EnvObject.equals``): shared, a neighbour's load would
      make later objects of this world take ids its existing objects have (seen: three steam
      objects equal to three older objects). Each simulator keeps its own count;
    * the random generator (``scala.util.Random``): every load seeds it and lays the world out
      from it; stochastic dynamics draw from it while stepping (bees, Punnett squares). Each
      simulator gets a ``java.util.Random`` of its own, put behind ``scala.util.Random`` while it
      runs (its private ``self`` field, set by reflection: Scala's classes are in no Java module,
      so Java 17 allows it), so its draws follow its own seed as in a JVM of its own.

    Both are swapped when a call of another simulator comes next (three round trips; none while
    one simulator runs call after call). With calls serialised, a simulator then sees what it
    would see alone in a JVM of its own (a test replays interleaved and concurrent episodes
    against one).
    """

    def __init__(self, client: Any) -> None:
        self._new_random = _java_class(client, "java.util.Random")
        self._ids = _scala_object(client, "util.UniqueIdentifier")
        self._random_holder = _scala_object(client, "scala.util.Random")
        self._random_field: Any = None
        try:
            field = _java_class(client, "java.lang.Class").forName("scala.util.Random").getDeclaredField("self")
            field.setAccessible(True)
            self._random_field = field
        except Py4JJavaError as error:  # a Java that forbids it: only stochastic dynamics are affected
            log.warning("ScienceWorld simulators of a JVM will share its random generator: %s", error)

    def switch(self, previous: Simulator | None, simulator: Simulator) -> None:
        """Save `previous`'s state from the singletons and put `simulator`'s in."""
        if previous is not None:
            previous._object_ids = int(self._ids.count())
        getattr(self._ids, "count_$eq")(simulator._object_ids)
        if self._random_field is not None:
            if simulator._random is None:
                simulator._random = self._new_random()  # seeded by its first load
            self._random_field.set(self._random_holder, simulator._random)


class Simulator:
    """One ScienceWorld simulator (a ``PythonInterface``) in a `ScienceWorldJVM`, maybe one of several.

    Each method is one operation that holds the JVM's lock. Not for concurrent use: the pool leases
    a simulator to one episode at a time.
    """

    def __init__(self, jvm: ScienceWorldJVM, index: int) -> None:
        self.jvm = jvm
        self.index = index
        self._server: Any = None  # its PythonInterface, created by `ScienceWorldJVM.add_simulator`
        self._object_ids = 0  # its object counter while another simulator runs (see _SharedState)
        self._random: Any = None  # its random generator (a java.util.Random; see _SharedState)

    @property
    def pid(self) -> int:
        return self.jvm.pid

    def alive(self) -> bool:
        return self.jvm.alive()

    def __repr__(self) -> str:
        return f"<Simulator {self.index} of JVM pid={self.jvm.pid}>"

    def call(self, name: str, *args: Any) -> Any:
        """Call a PythonInterface method (a dead or hung JVM raises JVMDiedError with the reason)."""
        with self.jvm.exclusive(self):
            return getattr(self._server, name)(*args)

    def load(self, task_name: str, variation: int, gold_path: bool = False) -> None:
        with self.jvm.exclusive(self):
            error: str = self._server.load(task_name, variation, "", gold_path)
        if error:
            raise ValueError(f"ScienceWorld could not load {task_name} variation {variation}: {error}")

    def step(self, action: str) -> tuple[str, float, bool, int]:
        """The raw step: (observation, score in 0-1 or -1 on failure, completed, moves)."""
        with self.jvm.exclusive(self):
            server = self._server
            observation: str = server.step(action)
            return observation, float(server.getScore()), bool(server.getCompleted()), int(server.getNumMoves())

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
        with self.jvm.exclusive(self):
            text: str = getattr(self._server, name)().toString()
        inner = text.strip().removeprefix("[").removesuffix("]").strip()
        return [int(item) for item in inner.split(",")] if inner else []

    def max_variations(self, task_name: str) -> int:
        return int(self.call("getTaskMaxVariations", task_name))

    def task_names(self) -> list[str]:
        return self._list_call("getTaskNames")

    def _list_call(self, name: str) -> list[str]:
        with self.jvm.exclusive(self):
            return self.jvm._strings(getattr(self._server, name)())

    def warm_up(self) -> None:
        """Load and step one small world so the classes the simulator needs are loaded and compiled."""
        self.load(*WARM_UP_TASK)
        self.step("look around")


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
                simulator = jvm.add_simulator()
                for task_name, variation in tasks:
                    simulator.load(task_name, variation)
                    simulator.step("look around")
                    simulator.valid_actions()
                    simulator.step("open door to kitchen")
                    simulator.inventory()
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
