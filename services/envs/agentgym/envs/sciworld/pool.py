"""A process-wide pool of ScienceWorld slots: warm JVMs reused across episodes.

Starting a ScienceWorld JVM costs seconds of CPU (class loading, the simulator's set-up, JIT), and
AgentGym's server started one per `/create` and never stopped it. Here a slot is one JVM with one
simulator in it; an episode leases a slot at its first reset, loads its task into it (a new world in
the same JVM, in tens of milliseconds), and hands it back on close. Slots are:

* started in parallel threads, off the event loop: `warm_slots` of them as soon as the pool is
  first used, more on demand up to `size` when every warm slot is leased;
* checked on lease and on return: a slot whose JVM died, stopped answering, or was returned while
  a call was still running inside it (a step that outlived the service's timeout) is killed and
  replaced, so the next episode always gets a working simulator.

`lease` waits up to its timeout for a free slot and then raises `PoolExhaustedError`, which names
the pool size to raise. One pool exists per distinct settings (`shared_pool`); all are closed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agentgym.envs.base import EnvironmentBusyError
from agentgym.envs.sciworld.jvm import (
    JVMError,
    JVMSettings,
    ScienceWorldJVM,
    build_cds_archive,
    usable_archive,
)

log = logging.getLogger(__name__)


class PoolExhaustedError(EnvironmentBusyError):
    """No slot became free within the lease timeout."""


class PoolClosedError(RuntimeError):
    """The pool was closed."""


@dataclass(frozen=True)
class PoolSettings:
    size: int = 8  # most JVMs at once
    warm_slots: int | None = None  # JVMs started up front (and kept replaced); None: all `size`
    jvm: JVMSettings = field(default_factory=JVMSettings)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"pool size must be at least 1, not {self.size}")
        if self.warm_slots is not None and not 0 <= self.warm_slots <= self.size:
            raise ValueError(f"warm_slots must be between 0 and the pool size ({self.size}), not {self.warm_slots}")

    @property
    def warm_target(self) -> int:
        return self.size if self.warm_slots is None else self.warm_slots


_slot_numbers = itertools.count(1)
_MAX_START_FAILURES = 3  # in a row: then leases fail fast with the reason instead of retrying


class Slot:
    """One warm JVM of a pool. Leased to one episode at a time."""

    def __init__(self, jvm: ScienceWorldJVM, startup_s: float) -> None:
        self.number = next(_slot_numbers)
        self.jvm = jvm
        self.startup_s = startup_s
        self.episodes = 0  # leases so far

    def alive(self) -> bool:
        return self.jvm.alive()

    def __repr__(self) -> str:
        return f"<Slot {self.number} pid={self.jvm.pid} episodes={self.episodes}>"


class SciWorldPool:
    """Warm ScienceWorld JVMs, leased to one episode at a time."""

    def __init__(self, settings: PoolSettings | None = None) -> None:
        self.settings = settings or PoolSettings()
        self._cond = threading.Condition()
        self._idle: deque[Slot] = deque()
        self._leased: set[Slot] = set()
        self._starting = 0
        self._started = False
        self._closed = False
        self._start_failures: deque[str] = deque(maxlen=5)
        self._consecutive_failures = 0
        self._last_failure = 0.0
        self._waiting = 0
        self.replaced = 0  # slots retired because they broke
        self.launched = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin warming `warm_slots` JVMs in background threads (idempotent, returns at once)."""
        if self._started:
            return
        archive_missing = self.settings.jvm.cds != "off" and usable_archive(self.settings.jvm) is None
        with self._cond:
            if self._started or self._closed:
                return
            self._started = True
            self._fill_locked()
        if archive_missing:
            threading.Thread(target=self._build_archive, name="sciworld-cds", daemon=True).start()

    def wait_warm(self, count: int | None = None, timeout: float | None = None) -> float:
        """Block until `count` slots (default: the warm target) are started; returns the seconds waited."""
        self.start()
        target = min(self.settings.size, self.settings.warm_target if count is None else count)
        began = time.monotonic()
        deadline = None if timeout is None else began + timeout
        with self._cond:
            while self._live_locked() - self._starting < target:
                self._fill_locked(target)
                if self._closed:
                    raise PoolClosedError("the ScienceWorld pool is closed")
                if self._starting == 0 and self._consecutive_failures >= _MAX_START_FAILURES:
                    raise JVMError(f"ScienceWorld slots fail to start: {self._start_failures[-1]}")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{target} ScienceWorld slots not warm within {timeout:g}s")
                self._cond.wait(remaining)
        return time.monotonic() - began

    def close(self) -> None:
        """Stop every JVM; leased slots are stopped when they come back."""
        with self._cond:
            self._closed = True
            idle = list(self._idle)
            self._idle.clear()
            self._cond.notify_all()
        for slot in idle:
            slot.jvm.close()

    # -- leasing ---------------------------------------------------------------------------------

    def lease(self, timeout: float = 60.0) -> Slot:
        """A warm slot for one episode; waits up to `timeout` seconds for one to be free."""
        self.start()
        deadline = time.monotonic() + timeout
        dead: list[Slot] = []
        try:
            with self._cond:
                if self._consecutive_failures >= _MAX_START_FAILURES and time.monotonic() - self._last_failure > 30:
                    self._consecutive_failures = 0  # try starting JVMs again now and then
                self._waiting += 1
                try:
                    while True:
                        if self._closed:
                            raise PoolClosedError("the ScienceWorld pool is closed")
                        while self._idle:
                            slot = self._idle.popleft()
                            if slot.alive():
                                slot.episodes += 1
                                self._leased.add(slot)
                                return slot
                            dead.append(slot)
                            self.replaced += 1
                        if self._consecutive_failures >= _MAX_START_FAILURES:
                            if self._starting == 0:
                                raise JVMError(f"ScienceWorld slots fail to start: {self._start_failures[-1]}")
                        elif self._starting < self._waiting and self._live_locked() < self.settings.size:
                            self._spawn_locked()  # one more JVM for this waiter, within the size
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise PoolExhaustedError(
                                f"all {self.settings.size} ScienceWorld slots are busy (waited {timeout:g}s); "
                                "close episodes or start the service with a larger pool_size"
                            )
                        self._cond.wait(remaining)
                finally:
                    self._waiting -= 1
        finally:
            for slot in dead:
                log.warning("discarding a dead idle slot: %s", slot.jvm.failure_reason())
                slot.jvm.kill()

    def release(self, slot: Slot, healthy: bool = True) -> None:
        """Hand a slot back. `healthy=False` (or a dead JVM) retires it and starts a replacement."""
        retire_reason: str | None = None
        with self._cond:
            if slot not in self._leased:
                return  # released twice
            self._leased.discard(slot)
            if self._closed:
                retire_reason = "pool closed"
            elif not healthy or not slot.alive():
                retire_reason = "broken"
                self.replaced += 1
            else:
                self._idle.append(slot)
            if retire_reason is not None and not self._closed:
                self._fill_locked()
            self._cond.notify_all()
        if retire_reason is not None:
            if retire_reason == "broken":
                log.warning("retiring ScienceWorld slot %s: %s", slot.number, slot.jvm.failure_reason())
            threading.Thread(target=slot.jvm.kill, name="sciworld-retire", daemon=True).start()

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._cond:
            slots = list(self._idle) + list(self._leased)
            return {
                "size": self.settings.size,
                "idle": len(self._idle),
                "leased": len(self._leased),
                "starting": self._starting,
                "launched": self.launched,
                "replaced": self.replaced,
                "heap_mb": self.settings.jvm.heap_mb,
                "pids": [slot.jvm.pid for slot in slots],
                "last_start_failure": self._start_failures[-1] if self._start_failures else None,
            }

    def slots(self) -> list[Slot]:
        with self._cond:
            return list(self._idle) + list(self._leased)

    # -- internals -------------------------------------------------------------------------------

    def _live_locked(self) -> int:
        return len(self._idle) + len(self._leased) + self._starting

    def _fill_locked(self, target: int | None = None) -> None:
        goal = min(self.settings.size, self.settings.warm_target if target is None else target)
        while self._live_locked() < goal and self._consecutive_failures < _MAX_START_FAILURES:
            self._spawn_locked()

    def _spawn_locked(self) -> None:
        self._starting += 1
        self.launched += 1
        threading.Thread(target=self._start_slot, name="sciworld-slot-start", daemon=True).start()

    def _start_slot(self) -> None:
        began = time.monotonic()
        jvm: ScienceWorldJVM | None = None
        try:
            jvm = ScienceWorldJVM(self.settings.jvm, archive=usable_archive(self.settings.jvm))
            jvm.warm_up()
        except Exception as error:
            reason = str(error) if isinstance(error, JVMError) else f"{type(error).__name__}: {error}"
            if jvm is not None:
                reason = jvm.failure_reason() if not jvm.alive() else reason
                jvm.kill()
            log.error("a ScienceWorld slot failed to start: %s", reason)
            with self._cond:
                self._starting -= 1
                self._start_failures.append(reason)
                self._consecutive_failures += 1
                self._last_failure = time.monotonic()
                if not self._closed:
                    self._fill_locked()
                self._cond.notify_all()
            return
        slot = Slot(jvm, time.monotonic() - began)
        with self._cond:
            self._starting -= 1
            self._consecutive_failures = 0
            if self._closed:
                close = True
            else:
                close = False
                self._idle.append(slot)
            self._cond.notify_all()
        if close:
            jvm.close()
        else:
            log.info("ScienceWorld slot %d warm in %.2fs (pid %d)", slot.number, slot.startup_s, jvm.pid)

    def _build_archive(self) -> None:
        try:
            build_cds_archive(self.settings.jvm)
        except Exception as error:  # an optimisation: JVMs start without it
            log.warning("could not build the ScienceWorld class-data archive: %s", error)


_POOLS: dict[PoolSettings, SciWorldPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(settings: PoolSettings) -> SciWorldPool:
    """The process's pool for these settings (created on first use)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(settings)
        if pool is None or pool._closed:
            pool = _POOLS[settings] = SciWorldPool(settings)
        return pool


def close_shared_pools() -> None:
    """Close every shared pool (at exit, and between test modules)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        with contextlib.suppress(Exception):
            pool.close()


atexit.register(close_shared_pools)
