"""A process-wide pool of ScienceWorld slots: warm simulators in shared JVMs, reused across episodes.

Starting a ScienceWorld JVM costs ~1.3 CPU-seconds (class loading, the simulator's set-up, JIT), and
AgentGym's server started one per `/create` and never stopped it. Here a slot is one simulator; a
JVM hosts up to `simulators_per_jvm` of them (an extra simulator in a warm JVM costs a few ms;
8 slots sharing a JVM hold ~20-40 MB resident each, a slot with a JVM of its own ~110-150 MB), so
8 slots cost one JVM start-up and seven cheap additions instead of eight start-ups competing for
the cores. An episode leases a slot at its first reset,
loads its task into it (a new world in the same simulator, in tens of milliseconds), and hands it
back on close. Slots are:

* started in background threads, off the event loop: `warm_slots` of them as soon as the pool is
  first used (JVMs in parallel, each filled up to `simulators_per_jvm`), more on demand up to
  `size` (if it has one) when every warm slot is leased (a simulator added to a JVM with room, else a
  new JVM);
* leased from the JVM with the fewest episodes, so load spreads over the JVMs (a JVM steps one
  simulator at a time);
* checked on lease and on return. A JVM's slots share its fate: when the JVM dies (killed, crashed,
  out of memory), stops answering, or a slot is returned while a call was still running inside it
  (a step that outlived the service's timeout, holding the JVM), the JVM is killed and every slot
  on it is retired. Episodes on those slots fail at their next call with the JVM's exit reason;
  replacements start at once, so the next episode always gets a working simulator.

`simulators_per_jvm=1` gives every slot a JVM of its own (full isolation, the old behaviour).

By default a pool has no size of its own: every episode that leases gets a slot (a new one when none
is idle), and the service's live-episode cap bounds them. With a `size`, `lease` waits up to its
timeout for a free slot and then raises `PoolExhaustedError`, which names the pool size to raise.
One pool exists per distinct settings (`shared_pool`); all are closed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agentgym.envs.base import EnvironmentBusyError
from agentgym.envs.sciworld.jvm import (
    JVMError,
    JVMSettings,
    ScienceWorldJVM,
    Simulator,
    build_cds_archive,
    usable_archive,
)

log = logging.getLogger(__name__)

# 8 simulators per JVM: a default pool (8 slots) is one JVM. Measured on 2 cores
# (benchmarks/sciworld_bench.py): 8 slots warm up in ~1.1x the time of one (2 JVMs of 4: ~1.9x,
# 8 JVMs: ~7.5x), at ~20-40 MB resident per slot (2 JVMs of 4: ~31 MB idle; 8 JVMs: ~107 MB).
# The price: shared fate (a JVM that dies fails its 8 episodes) and one JVM's step throughput for
# 8 slots (a step takes milliseconds, an agent's turn seconds; with all 8 stepping flat out on 2
# cores, ~30 % fewer steps than 8 JVMs). Lower it for isolation or step-bound workloads.
DEFAULT_SIMULATORS_PER_JVM = 8


class PoolExhaustedError(EnvironmentBusyError):
    """No slot became free within the lease timeout."""


class PoolClosedError(RuntimeError):
    """The pool was closed."""


@dataclass(frozen=True)
class PoolSettings:
    # Most slots (simulators) at once. None: no cap of the pool's own, one slot per episode that wants one
    # (the service's live-episode cap bounds them): a pool smaller than the service's cap left the episodes
    # past it waiting for a slot until their reset timed out.
    size: int | None = None
    warm_slots: int | None = None  # slots started up front (and kept replaced); None: all `size` (uncapped: 8)
    simulators_per_jvm: int = DEFAULT_SIMULATORS_PER_JVM  # slots sharing one JVM (1: a JVM each)
    jvm: JVMSettings = field(default_factory=JVMSettings)

    def __post_init__(self) -> None:
        if self.size is not None and self.size < 1:
            raise ValueError(f"pool size must be at least 1, not {self.size}")
        too_many = self.size is not None and self.warm_slots is not None and self.warm_slots > self.size
        if self.warm_slots is not None and (self.warm_slots < 0 or too_many):
            raise ValueError(f"warm_slots must be between 0 and the pool size ({self.size}), not {self.warm_slots}")
        if self.simulators_per_jvm < 1:
            raise ValueError(f"simulators_per_jvm must be at least 1, not {self.simulators_per_jvm}")

    @property
    def warm_target(self) -> int:
        if self.warm_slots is not None:
            return self.warm_slots
        return self.size if self.size is not None else DEFAULT_SIMULATORS_PER_JVM

    def capped(self, slots: int) -> int:
        """`slots`, or the pool's size where that is smaller."""
        return slots if self.size is None else min(self.size, slots)

    @property
    def jvm_capacity(self) -> int:
        """Simulators per JVM, never more than the pool holds (the heap cap scales with it)."""
        return self.capped(self.simulators_per_jvm)


_slot_numbers = itertools.count(1)
_host_numbers = itertools.count(1)
_MAX_START_FAILURES = 3  # in a row: then leases fail fast with the reason instead of retrying


class _Host:
    """One JVM of a pool and the slots on it (pool-internal; guarded by the pool's lock)."""

    def __init__(self, capacity: int) -> None:
        self.number = next(_host_numbers)
        self.capacity = capacity
        self.jvm: ScienceWorldJVM | None = None  # None while its process starts
        self.slots: list[Slot] = []
        self.pending = 0  # simulators to be created on it (its grower thread works them off)
        self.growing = False
        self.retired = False

    @property
    def room(self) -> int:
        return self.capacity - len(self.slots) - self.pending

    def __repr__(self) -> str:
        pid = None if self.jvm is None else self.jvm.pid
        return f"<JVM host {self.number} pid={pid} slots={len(self.slots)}/{self.capacity}>"


class Slot:
    """One warm simulator of a pool. Leased to one episode at a time."""

    def __init__(self, host: _Host, sim: Simulator, startup_s: float) -> None:
        self.number = next(_slot_numbers)
        self.host = host
        self.sim = sim
        self.startup_s = startup_s
        self.episodes = 0  # leases so far
        self.lost = False  # its JVM was retired: the slot is dead for good

    @property
    def jvm(self) -> ScienceWorldJVM:
        return self.sim.jvm

    def alive(self) -> bool:
        return not self.lost and self.sim.alive()

    def __repr__(self) -> str:
        return f"<Slot {self.number} pid={self.jvm.pid} simulator={self.sim.index} episodes={self.episodes}>"


class SciWorldPool:
    """Warm ScienceWorld simulators in shared JVMs, leased to one episode at a time."""

    def __init__(self, settings: PoolSettings | None = None) -> None:
        self.settings = settings or PoolSettings()
        self._cond = threading.Condition()
        self._hosts: list[_Host] = []  # live JVMs (and JVMs starting)
        self._idle: list[Slot] = []
        self._leased: set[Slot] = set()
        self._started = False
        self._closed = False
        self._start_failures: list[str] = []
        self._consecutive_failures = 0
        self._last_failure = 0.0
        self._waiting = 0
        self.replaced = 0  # slots retired because they (their JVM) broke
        self.launched = 0  # JVMs started

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin warming `warm_slots` slots in background threads (idempotent, returns at once)."""
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
        target = self.settings.capped(self.settings.warm_target if count is None else count)
        began = time.monotonic()
        deadline = None if timeout is None else began + timeout
        with self._cond:
            while self._ready_locked() < target:
                self._fill_locked(target)
                if self._closed:
                    raise PoolClosedError("the ScienceWorld pool is closed")
                if self._starting_locked() == 0 and self._consecutive_failures >= _MAX_START_FAILURES:
                    raise JVMError(f"ScienceWorld slots fail to start: {self._start_failures[-1]}")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{target} ScienceWorld slots not warm within {timeout:g}s")
                self._cond.wait(remaining)
        return time.monotonic() - began

    def close(self) -> None:
        """Stop every JVM; one with leased slots is stopped when the last of them comes back."""
        with self._cond:
            self._closed = True
            self._idle.clear()
            closing = [host for host in self._hosts if not self._leased_on_locked(host)]
            for host in closing:
                self._hosts.remove(host)
                host.retired = True
            self._cond.notify_all()
        for host in closing:
            if host.jvm is not None:
                host.jvm.close()

    # -- leasing ---------------------------------------------------------------------------------

    def lease(self, timeout: float = 60.0) -> Slot:
        """A warm slot for one episode; waits up to `timeout` seconds for one to be free."""
        self.start()
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._consecutive_failures >= _MAX_START_FAILURES and time.monotonic() - self._last_failure > 30:
                self._consecutive_failures = 0  # try starting JVMs again now and then
            self._waiting += 1
            try:
                while True:
                    if self._closed:
                        raise PoolClosedError("the ScienceWorld pool is closed")
                    slot = self._pick_idle_locked()
                    if slot is not None:
                        slot.episodes += 1
                        self._leased.add(slot)
                        return slot
                    if self._consecutive_failures >= _MAX_START_FAILURES:
                        if self._starting_locked() == 0:
                            raise JVMError(f"ScienceWorld slots fail to start: {self._start_failures[-1]}")
                    elif self._starting_locked() < self._waiting and self._has_room_locked():
                        self._fill_locked(self._live_locked() + 1)  # one more slot for this waiter
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        if self.settings.size is None:
                            raise PoolExhaustedError(
                                f"no ScienceWorld slot started within {timeout:g}s "
                                f"({self._starting_locked()} starting, {len(self._leased)} leased)"
                            )
                        raise PoolExhaustedError(
                            f"all {self.settings.size} ScienceWorld slots are busy (waited {timeout:g}s); "
                            "close episodes or start the service with a larger pool_size"
                        )
                    self._cond.wait(remaining)
            finally:
                self._waiting -= 1

    def release(self, slot: Slot, healthy: bool = True) -> None:
        """Hand a slot back. `healthy=False` (or a dead JVM) retires its JVM, with every slot on it."""
        with self._cond:
            if slot not in self._leased:
                return  # released twice
            self._leased.discard(slot)
            host = slot.host
            if slot.lost:
                pass  # its JVM is already retired (and replaced)
            elif self._closed:
                if not self._leased_on_locked(host):
                    self._retire_locked(host, replace=False)
            elif not slot.alive():
                self._retire_locked(host, reason="its JVM died")
            elif not healthy:
                self._retire_locked(host, reason="a slot came back broken (a call still running in it holds the JVM)")
            else:
                self._idle.append(slot)
            self._cond.notify_all()

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "size": self.settings.size,
                "simulators_per_jvm": self.settings.jvm_capacity,
                "idle": len(self._idle),
                "leased": sum(1 for slot in self._leased if not slot.lost),
                "starting": self._starting_locked(),
                "jvms": len(self._hosts),
                "launched": self.launched,
                "replaced": self.replaced,
                "heap_mb": self.settings.jvm.heap_mb,
                "jvm_heap_mb": self.settings.jvm.max_heap_mb(self.settings.jvm_capacity),
                "pids": [host.jvm.pid for host in self._hosts if host.jvm is not None],
                "last_start_failure": self._start_failures[-1] if self._start_failures else None,
            }

    def slots(self) -> list[Slot]:
        """The live slots, idle first."""
        with self._cond:
            return list(self._idle) + [slot for slot in self._leased if not slot.lost]

    # -- internals -------------------------------------------------------------------------------

    def _starting_locked(self) -> int:
        return sum(host.pending for host in self._hosts)

    def _ready_locked(self) -> int:
        return len(self._idle) + sum(1 for slot in self._leased if not slot.lost)

    def _live_locked(self) -> int:
        return self._ready_locked() + self._starting_locked()

    def _has_room_locked(self) -> bool:
        """Another slot may start (the pool is uncapped, or below its size)."""
        return self.settings.size is None or self._live_locked() < self.settings.size

    def _leased_on_locked(self, host: _Host) -> int:
        return sum(1 for slot in self._leased if slot.host is host)

    def _pick_idle_locked(self) -> Slot | None:
        """The idle slot on the JVM with the fewest leased slots (first returned among equals)."""
        best: Slot | None = None
        best_load = 0
        for slot in list(self._idle):
            if not slot.alive():
                if not slot.lost:  # its JVM died and the exit callback has not run yet
                    self._retire_locked(slot.host, reason="its JVM died")
                continue
            load = self._leased_on_locked(slot.host)
            if best is None or load < best_load:
                best, best_load = slot, load
        if best is not None:
            self._idle.remove(best)
        return best

    def _fill_locked(self, target: int | None = None) -> None:
        """Start slots up to `target` (default the warm target): on JVMs with room first, then new JVMs."""
        goal = self.settings.capped(self.settings.warm_target if target is None else target)
        need = goal - self._live_locked()
        if need <= 0 or self._closed or self._consecutive_failures >= _MAX_START_FAILURES:
            return
        for host in self._hosts:
            if need <= 0:
                return
            add = min(host.room, need)
            if add > 0 and (host.jvm is None or host.jvm.alive()):
                self._grow_locked(host, add)
                need -= add
        while need > 0:
            host = _Host(self.settings.jvm_capacity)
            self._hosts.append(host)
            self.launched += 1
            add = min(host.capacity, need)
            self._grow_locked(host, add)
            need -= add

    def _grow_locked(self, host: _Host, count: int) -> None:
        host.pending += count
        if not host.growing:
            host.growing = True
            threading.Thread(target=self._grow, args=(host,), name="sciworld-slot-start", daemon=True).start()

    def _grow(self, host: _Host) -> None:
        """Start the host's JVM if needed, then create simulators on it while it has some pending."""
        began = time.monotonic()
        try:
            if host.jvm is None:
                jvm = ScienceWorldJVM(
                    self.settings.jvm, capacity=host.capacity, archive=usable_archive(self.settings.jvm)
                )
                with self._cond:
                    host.jvm = jvm
                    retired = host.retired  # the pool closed, or gave up on it, while it started
                if retired:
                    jvm.kill()
                    return
                jvm.on_exit(lambda _: self._jvm_exited(host))
                first = jvm.add_simulator()
                first.warm_up()  # the JVM's classes loaded and compiled, for this and later simulators
                if not self._publish(host, first, began):
                    return
            assert host.jvm is not None
            while True:
                with self._cond:
                    if host.pending <= 0 or host.retired:
                        host.growing = False
                        return
                began = time.monotonic()
                # Not loaded: the JVM is warm, and every load builds its world (and task table) afresh.
                if not self._publish(host, host.jvm.add_simulator(), began):
                    return
        except Exception as error:
            self._grow_failed(host, error)

    def _publish(self, host: _Host, sim: Simulator, began: float) -> bool:
        """A new simulator is ready: add its slot to the idle ones. False when the host is retired."""
        slot = Slot(host, sim, time.monotonic() - began)
        with self._cond:
            if host.retired:
                host.growing = False
                return False
            host.pending -= 1
            host.slots.append(slot)
            self._idle.append(slot)
            self._consecutive_failures = 0
            self._cond.notify_all()
        log.info(
            "ScienceWorld slot %d warm in %.2fs (pid %d, simulator %d)", slot.number, slot.startup_s, sim.pid, sim.index
        )
        return True

    def _grow_failed(self, host: _Host, error: Exception) -> None:
        reason = str(error) if isinstance(error, JVMError) else f"{type(error).__name__}: {error}"
        jvm = host.jvm
        if jvm is not None and not jvm.alive():
            reason = jvm.failure_reason()
        with self._cond:
            host.pending = 0
            host.growing = False
            if host.retired:  # killed on purpose (pool closed), or its death is already handled
                return
            log.error("a ScienceWorld slot failed to start: %s", reason)
            self._start_failed_locked(reason)
            if jvm is None or not jvm.alive() or not host.slots:
                self._retire_locked(host, reason=reason, count_replaced=False)
            elif not self._closed:
                self._fill_locked()
            self._cond.notify_all()

    def _jvm_exited(self, host: _Host) -> None:
        """The JVM's process is gone (from its output reader thread): retire it and its slots."""
        with self._cond:
            if host.retired:
                return  # stopped on purpose
            starting = not host.slots
            if starting:  # died while starting: a start failure, so one that cannot start is not retried forever
                assert host.jvm is not None
                self._start_failed_locked(host.jvm.failure_reason())
            self._retire_locked(host, reason="its JVM died", count_replaced=not starting)
            self._cond.notify_all()

    def _start_failed_locked(self, reason: str) -> None:
        self._start_failures = [*self._start_failures[-4:], reason]
        self._consecutive_failures += 1
        self._last_failure = time.monotonic()

    def _retire_locked(self, host: _Host, reason: str = "", replace: bool = True, count_replaced: bool = True) -> None:
        """Take a JVM and all its slots out of service, kill it (in a thread), start replacements."""
        if host.retired:
            return
        host.retired = True
        host.pending = 0
        if host in self._hosts:
            self._hosts.remove(host)
        lost = [slot for slot in host.slots if not slot.lost]
        for slot in lost:
            slot.lost = True
        self._idle = [slot for slot in self._idle if slot.host is not host]
        if count_replaced:
            self.replaced += len(lost)
        jvm = host.jvm
        if reason and jvm is not None:
            detail = jvm.failure_reason() if not jvm.alive() else reason
            log.warning("retiring ScienceWorld JVM pid %d and its %d slot(s): %s", jvm.pid, len(lost), detail)
        if jvm is not None:
            threading.Thread(target=jvm.kill, name="sciworld-retire", daemon=True).start()
        if replace and not self._closed:
            self._fill_locked()

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
