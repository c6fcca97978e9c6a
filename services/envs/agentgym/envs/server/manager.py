"""Live episodes of one environment kind, shared by the HTTP and gRPC front ends.

The manager owns the bounds: a cap on live episodes, an idle timeout (and a shorter one for episodes
opened and never stepped), a per-step timeout, and a thread pool so that CPU-bound environment code
never runs on the event loop. A call's timeout counts from when a worker thread starts it: waiting for a
free worker is the service being busy, not the environment hanging, and has its own, longer bound.
An exception inside an episode (or a step that outlives its timeout) ends *that* episode as failed,
with the reason; the service and every other episode carry on.

Closing an episode while a call on it runs (a step, a reset) takes it out of the table at once (its
id is unknown from then on, its place under the cap is free) but closes its environment only when
that call is done with it: environments are not thread-safe, and closing one under a running step
would make the step fail. That call is answered with `EpisodeClosedError` (409), not as a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agentgym.cpus import available_cpus
from agentgym.envs.base import (
    Environment,
    EnvironmentBusyError,
    ResetResult,
    StepResult,
    TaskCatalog,
    UnknownTaskError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

EpisodeStatus = Literal["open", "running", "done", "failed"]


class EpisodeNotFoundError(LookupError):
    def __init__(self, episode_id: str) -> None:
        super().__init__(f"no live episode with id {episode_id!r} (closed, expired, or never created)")


class CapacityError(RuntimeError):
    def __init__(self, cap: int | None = None, message: str | None = None) -> None:
        super().__init__(message or f"live-episode cap reached ({cap}); close episodes or retry later")


class EpisodeStateError(RuntimeError):
    """The episode exists but cannot take this call (no task yet, already done, or failed)."""


class EpisodeClosedError(EpisodeStateError):
    """The episode was closed while this call waited for it or ran on it; the call's outcome is discarded."""

    def __init__(self, episode_id: str) -> None:
        super().__init__(f"episode {episode_id!r} was closed while this call was in flight; its outcome is discarded")


class WorkerWaitTimeoutError(TimeoutError):
    """A call waited past `worker_wait_timeout_s` for a free worker thread and was dropped unstarted."""


class EnvironmentCrashError(RuntimeError):
    """The environment raised while resetting; the episode is discarded."""


@dataclass
class ManagerConfig:
    max_episodes: int = 256
    idle_timeout_s: float = 600.0
    # An episode opened (or reset) and never stepped holds a place under the cap for nothing: a client
    # that died right after creating it, or a fuzzer. It is reaped after this (the idle timeout if
    # shorter). Real clients step within seconds of opening: the rollout worker's first step waits for
    # one sampled reply only.
    never_stepped_timeout_s: float = 60.0
    step_timeout_s: float = 30.0
    reset_timeout_s: float = 120.0
    # How long a call may wait for a free worker thread before its episode fails. Rollouts step all
    # their episodes at once after a batched decode, so a burst of calls queues behind the workers; on a
    # busy 2-core machine 64 WebArena episodes waited ~30 s and, when the step timeout counted that wait,
    # a quarter of an eval's episodes ended as "timed out". The rollout client gives up after 60 s.
    worker_wait_timeout_s: float = 60.0
    # Few threads, not one per episode: they also bound how many calls hit the engine at once (64 WebArena
    # resets at once timed out Chromium's page loads). So no environment call may wait long for another
    # episode (the SciWorld pool starts a slot rather than wait for a free one).
    worker_threads: int = field(default_factory=lambda: min(32, 4 * available_cpus()))
    reap_interval_s: float = 15.0


@dataclass
class Episode:
    episode_id: str
    env: Environment
    created_at: float
    last_used: float
    task_id: str | None = None
    status: EpisodeStatus = "open"
    failure: str | None = None
    steps: int = 0
    score: float = 0.0
    observation: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stepped: bool = False  # a step was ever taken (the never-stepped timeout no longer applies)
    closed: bool = False  # out of the manager's table; the environment is closed by the last call using it


class ServiceMetrics:
    """Prometheus metrics of one service (own registry, so several apps can live in one process)."""

    def __init__(self, environment: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"environment": environment}
        self.live_episodes = Gauge(
            "agentgym_env_episodes_live", "Live episodes", ["environment"], registry=self.registry
        ).labels(**labels)
        self.created = Counter(
            "agentgym_env_episodes_created", "Episodes created", ["environment"], registry=self.registry
        ).labels(**labels)
        self.closed = Counter(
            "agentgym_env_episodes_closed",
            "Episodes closed or reaped",
            ["environment", "reason"],
            registry=self.registry,
        )
        self.failed = Counter(
            "agentgym_env_episodes_failed",
            "Episodes ended by an environment error or timeout",
            ["environment", "reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "agentgym_env_requests_rejected",
            "Requests refused (cap, unknown id, bad state)",
            ["environment", "reason"],
            registry=self.registry,
        )
        self.steps = Counter("agentgym_env_steps", "Environment steps", ["environment"], registry=self.registry).labels(
            **labels
        )
        self.step_seconds = Histogram(
            "agentgym_env_step_seconds",
            "Time inside env.step",
            ["environment"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ).labels(**labels)
        self.worker_wait_seconds = Histogram(
            "agentgym_env_worker_wait_seconds",
            "Time a call waited for a free worker thread",
            ["environment"],
            registry=self.registry,
            buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60),
        ).labels(**labels)
        self.environment = environment


class EpisodeManager:
    """Creates, steps and reaps episodes of one environment kind."""

    def __init__(
        self,
        environment: str,
        factory: Callable[[], Environment],
        catalog: TaskCatalog,
        config: ManagerConfig | None = None,
    ) -> None:
        self.environment = environment
        self.config = config or ManagerConfig()
        self.catalog = catalog
        self.metrics = ServiceMetrics(environment)
        self._factory = factory
        self._episodes: dict[str, Episode] = {}
        self._pending_creates = 0
        self._executor = ThreadPoolExecutor(
            max_workers=self.config.worker_threads, thread_name_prefix=f"env-{environment}"
        )
        self._reaper: asyncio.Task[None] | None = None
        self._counter = itertools.count(1)
        self._prefix = secrets.token_hex(3)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name=f"reaper-{self.environment}")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        # Close every episode (returning JVMs, browsers, ...) before the pool goes: queued closes
        # run first; a step still stuck past its timeout cannot hold shutdown up for long.
        closing = [self._discard(episode_id, reason="shutdown") for episode_id in list(self._episodes)]
        await asyncio.gather(*closing)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(loop.run_in_executor(None, self._executor.shutdown, True), timeout=30)

    @property
    def live_episodes(self) -> int:
        return len(self._episodes)

    def healthy(self) -> bool:
        return not self._executor._shutdown

    # -- episode operations ----------------------------------------------------------------------

    def resolve_task(self, task_id: str | None = None, split: str | None = None, index: int | None = None) -> str:
        """A task id from either an id or (split, index); raises UnknownTaskError."""
        if task_id is not None:
            self.catalog.describe(task_id)  # validates
            return task_id
        if split is None or index is None:
            raise UnknownTaskError("name a task: task_id, or split and index")
        return self.catalog.task_id(split, index)

    async def open(self, task_id: str | None = None) -> tuple[Episode, ResetResult | None]:
        """A new episode; reset to `task_id` when given. Raises CapacityError, UnknownTaskError."""
        if task_id is not None:
            self.catalog.describe(task_id)
        if len(self._episodes) + self._pending_creates >= self.config.max_episodes:
            self.metrics.rejected.labels(self.environment, "capacity").inc()
            raise CapacityError(self.config.max_episodes)
        self._pending_creates += 1
        try:
            env = await self._in_thread(self._factory, self.config.reset_timeout_s)
        except Exception as error:
            raise EnvironmentCrashError(f"could not start a {self.environment} instance: {_describe(error)}") from error
        finally:
            self._pending_creates -= 1
        now = time.monotonic()
        episode = Episode(f"{self._prefix}-{next(self._counter)}", env, created_at=now, last_used=now)
        self._episodes[episode.episode_id] = episode
        self.metrics.created.inc()
        self.metrics.live_episodes.set(len(self._episodes))
        if task_id is None:
            return episode, None
        try:
            first = await self.reset(episode.episode_id, task_id)
        except Exception:
            await self._discard(episode.episode_id, reason="reset_failed")
            raise
        return episode, first

    async def reset(self, episode_id: str, task_id: str) -> ResetResult:
        episode = self.get(episode_id)
        self.catalog.describe(task_id)
        async with self._holding(episode):
            if episode.status == "failed":
                # The old instance crashed: give the episode a fresh one.
                try:
                    fresh = await self._in_thread(self._factory, self.config.reset_timeout_s)
                except Exception as error:
                    raise EnvironmentCrashError(
                        f"could not start a {self.environment} instance: {_describe(error)}"
                    ) from error
                episode.env = fresh
                self._check_open(episode)
            episode.status = "running"
            try:
                result = await self._in_thread(lambda: episode.env.reset(task_id), self.config.reset_timeout_s)
            except EnvironmentBusyError as error:
                episode.status = "open"  # nothing broke: the episode can be reset again later
                self.metrics.rejected.labels(self.environment, "busy").inc()
                raise CapacityError(message=f"{self.environment} is busy: {error}") from error
            except Exception as error:
                self._check_open(episode)  # closed meanwhile: that is why it failed, not the environment
                reason = f"reset of {task_id!r} failed: {_describe(error)}"
                self._fail(episode, reason, error)
                raise EnvironmentCrashError(reason) from error
            self._check_open(episode)
            episode.task_id = task_id
            episode.steps = 0
            episode.score = 0.0
            episode.failure = None
            episode.observation = result.observation
            episode.last_used = time.monotonic()
            return result

    async def step(self, episode_id: str, action: str) -> StepResult:
        """One action. An environment crash or timeout returns a final failed StepResult."""
        episode = self.get(episode_id)
        async with self._holding(episode):
            self._check_steppable(episode)
            episode.stepped = True
            started = time.perf_counter()
            try:
                result = await self._in_thread(lambda: episode.env.step(action), self.config.step_timeout_s)
            except Exception as error:
                self._check_open(episode)  # closed meanwhile: not an environment failure
                if isinstance(error, WorkerWaitTimeoutError):
                    reason = str(error)
                elif isinstance(error, TimeoutError):
                    reason = f"step timed out after {self.config.step_timeout_s:g}s"
                else:
                    reason = f"environment error: {_describe(error)}"
                self._fail(episode, reason, error)
                return StepResult(
                    observation=f"The episode ended: {reason}.",
                    reward=0.0,
                    done=True,
                    score=episode.score,
                    info={"failed": True, "error": reason, "invalid_action": False, "success": False},
                )
            finally:
                episode.last_used = time.monotonic()
            self._check_open(episode)
            self.metrics.step_seconds.observe(time.perf_counter() - started)
            self.metrics.steps.inc()
            episode.steps += 1
            episode.score = result.score
            episode.observation = result.observation
            if result.done or result.truncated:
                episode.status = "done"
            return result

    async def observe(self, episode_id: str) -> Episode:
        episode = self.get(episode_id)
        episode.last_used = time.monotonic()
        return episode

    async def available_actions(self, episode_id: str) -> list[str] | None:
        episode = self.get(episode_id)
        async with self._holding(episode):
            if episode.task_id is None:
                raise EpisodeStateError(f"episode {episode_id!r} has no task yet; reset it first")
            episode.last_used = time.monotonic()
            actions = await self._in_thread(episode.env.available_actions, self.config.step_timeout_s)
            self._check_open(episode)
            return actions

    async def call(self, episode_id: str, fn: Callable[[Environment], T]) -> T:
        """Run an environment-specific method of an episode off the event loop (compat routes)."""
        episode = self.get(episode_id)
        async with self._holding(episode):
            episode.last_used = time.monotonic()
            value = await self._in_thread(lambda: fn(episode.env), self.config.step_timeout_s)
            self._check_open(episode)
            return value

    async def close(self, episode_id: str) -> None:
        self.get(episode_id)
        await self._discard(episode_id, reason="closed")

    def get(self, episode_id: str) -> Episode:
        episode = self._episodes.get(episode_id)
        if episode is None:
            self.metrics.rejected.labels(self.environment, "unknown_episode").inc()
            raise EpisodeNotFoundError(episode_id)
        return episode

    def stats(self) -> dict[str, Any]:
        by_status: dict[str, int] = {}
        for episode in self._episodes.values():
            by_status[episode.status] = by_status.get(episode.status, 0) + 1
        return {
            "environment": self.environment,
            "live": len(self._episodes),
            "by_status": by_status,
            "max_episodes": self.config.max_episodes,
        }

    # -- internals -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _holding(self, episode: Episode) -> AsyncIterator[None]:
        """Hold the episode's lock for one call; if the episode is closed meanwhile, close its
        environment once the call is done with it (`_discard` leaves that to the holder)."""
        async with episode.lock:
            try:
                self._check_open(episode)
                yield
            finally:
                if episode.closed:
                    self._close_env(episode)

    def _check_open(self, episode: Episode) -> None:
        if episode.closed:
            self.metrics.rejected.labels(self.environment, "closed").inc()
            raise EpisodeClosedError(episode.episode_id)

    def _close_env(self, episode: Episode) -> None:
        """Close the episode's environment, once (later calls find the closed stand-in)."""
        env = episode.env
        if isinstance(env, _ClosedEnvironment):
            return
        episode.env = _ClosedEnvironment("the episode was closed")
        if self._executor._shutdown:
            _close_quietly(env)
        else:
            self._executor.submit(_close_quietly, env)

    def _check_steppable(self, episode: Episode) -> None:
        if episode.task_id is None:
            self.metrics.rejected.labels(self.environment, "no_task").inc()
            raise EpisodeStateError(f"episode {episode.episode_id!r} has no task yet; reset it first")
        if episode.status == "failed":
            self.metrics.rejected.labels(self.environment, "failed").inc()
            raise EpisodeStateError(f"episode {episode.episode_id!r} failed: {episode.failure}")
        if episode.status == "done":
            self.metrics.rejected.labels(self.environment, "done").inc()
            raise EpisodeStateError(f"episode {episode.episode_id!r} is over; reset it or open a new one")

    def _fail(self, episode: Episode, reason: str, error: BaseException) -> None:
        episode.status = "failed"
        episode.failure = reason
        if isinstance(error, WorkerWaitTimeoutError):
            kind = "worker_wait"
        elif isinstance(error, TimeoutError):
            kind = "timeout"
        else:
            kind = type(error).__name__
        self.metrics.failed.labels(self.environment, kind).inc()
        log.warning("episode %s (%s) failed: %s", episode.episode_id, episode.task_id, reason)
        # A broken instance may hold a dead process or be mid-step in a thread: replace it.
        broken, episode.env = episode.env, _BrokenEnvironment(reason)
        self._executor.submit(_close_quietly, broken)

    async def _in_thread(self, fn: Callable[[], T], timeout: float) -> T:
        """`fn()` on a worker thread, allowed `timeout` seconds from when a worker starts it.

        Raises WorkerWaitTimeoutError (the call never ran) when no worker is free within
        `worker_wait_timeout_s`, TimeoutError when the call outlives `timeout` (its thread runs on)."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = loop.create_future()
        # A worker starting the call and the loop dropping it decide under this lock, exactly once.
        gate = threading.Lock()
        state = {"started": False, "dropped": False}

        def run() -> T:
            with gate:
                if state["dropped"]:
                    raise asyncio.CancelledError
                state["started"] = True
            # Scheduled before the call's own result, so the loop sees `started` first.
            loop.call_soon_threadsafe(_resolve, started)
            return fn()

        queued_at = time.perf_counter()
        call = loop.run_in_executor(self._executor, run)
        first: set[asyncio.Future[Any]] = {started, call}
        try:
            await asyncio.wait(first, timeout=self.config.worker_wait_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller went away
            with gate:
                state["dropped"] = not state["started"]
            if state["dropped"]:
                call.cancel()
            raise
        with gate:
            state["dropped"] = not state["started"]
        self.metrics.worker_wait_seconds.observe(time.perf_counter() - queued_at)
        if state["dropped"]:
            call.cancel()
            raise WorkerWaitTimeoutError(
                f"waited {self.config.worker_wait_timeout_s:g}s for a free worker thread "
                f"(all {self.config.worker_threads} busy)"
            )
        return await asyncio.wait_for(call, timeout)

    async def _discard(self, episode_id: str, reason: str) -> None:
        episode = self._episodes.pop(episode_id, None)
        if episode is None:
            return
        episode.closed = True
        self.metrics.closed.labels(self.environment, reason).inc()
        self.metrics.live_episodes.set(len(self._episodes))
        if not episode.lock.locked():
            self._close_env(episode)
        # else a call holds the episode, maybe running in a worker thread: it closes the environment
        # when it is done (`_holding`), and answers EpisodeClosedError.

    def _never_stepped_timeout(self) -> float:
        return min(self.config.never_stepped_timeout_s, self.config.idle_timeout_s)

    async def reap_idle(self) -> int:
        """Close episodes idle past the idle timeout, or never stepped past the shorter timeout; how many."""
        now = time.monotonic()
        idle_deadline = now - self.config.idle_timeout_s
        unstepped_deadline = now - self._never_stepped_timeout()
        reaped = 0
        for episode in list(self._episodes.values()):
            if episode.lock.locked():
                continue
            if episode.last_used < idle_deadline:
                reason = "idle"
            elif not episode.stepped and episode.last_used < unstepped_deadline:
                reason = "never_stepped"
            else:
                continue
            await self._discard(episode.episode_id, reason=reason)
            reaped += 1
        return reaped

    async def _reap_forever(self) -> None:
        shortest = self._never_stepped_timeout()
        while True:
            await asyncio.sleep(min(self.config.reap_interval_s, max(shortest / 4, 0.05)))
            try:
                reaped = await self.reap_idle()
                if reaped:
                    log.info("reaped %d idle %s episodes", reaped, self.environment)
            except Exception:  # the reaper must never die
                log.exception("idle reaper")


class _BrokenEnvironment(Environment):
    """Stands in for a crashed instance so late calls answer with the failure, not a traceback."""

    name = "broken"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    @classmethod
    def catalog(cls) -> TaskCatalog:
        raise NotImplementedError("a broken environment has no catalog")

    def reset(self, task_id: str) -> ResetResult:
        raise RuntimeError(self.reason)

    def step(self, action: str) -> StepResult:
        raise RuntimeError(self.reason)

    def observe(self) -> str:
        return f"The episode failed: {self.reason}"


class _ClosedEnvironment(_BrokenEnvironment):
    """Stands in for the environment of a closed episode (already closed, never closed twice)."""

    name = "closed"


def _close_quietly(env: Environment) -> None:
    try:
        env.close()
    except Exception:
        log.exception("closing an environment instance")


def _describe(error: BaseException) -> str:
    if isinstance(error, WorkerWaitTimeoutError):
        return str(error)
    if isinstance(error, TimeoutError):
        return "timed out"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
