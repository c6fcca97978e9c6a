"""The rollout worker process: RolloutRequests in from JetStream, Trajectories out.

Requests come from the run's work-queue stream through one durable pull consumer shared by every
worker. Each worker keeps up to `concurrency` episodes in flight (asyncio), publishes each
trajectory (deduplicated by id) and acks the request only after the trajectory is published; while
an episode runs it tells JetStream it is still in progress. On shutdown it stops fetching, lets
running episodes finish for a grace period, and hands the rest back (nak) for immediate redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import nats
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry import trace

from agentgym.messaging import RunChannels, decode_message, publish_message
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import EnvSession, EpisodeSettings, Policy, PolicyError, run_episode, trajectory_summary
from agentgym.rollout.prompts import template_for
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.telemetry import extract_context, inject_context

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    received: int = 0
    published: int = 0
    failed_episodes: int = 0
    rejected: int = 0
    by_termination: dict[str, int] = field(default_factory=dict)


class VersionedPolicy(Policy, Protocol):
    async def served_version(self) -> int: ...


@dataclass(frozen=True)
class WorkerConfig:
    run: str
    nats_url: str
    concurrency: int = 32
    # On-policy: an episode starts only once inference serves at least the request's policy version.
    version_wait_s: float = 600.0
    # Episodes in play are kept alive by in-progress heartbeats (every ack_wait / 3), so ack_wait bounds only how
    # long the requests of a worker that died wait before another worker gets them: 10 s, as long as its pod's
    # restart takes, where 30 s stalled a step for half a minute after every crash.
    ack_wait_s: float = 10.0
    shutdown_grace_s: float = 10.0
    durable: str = "rollout-workers"
    settings: EpisodeSettings = field(default_factory=EpisodeSettings)


class RolloutWorker:
    def __init__(
        self,
        config: WorkerConfig,
        policy: VersionedPolicy,
        chat: ChatTokenizer,
        environments: Mapping[str, EnvSession],
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.chat = chat
        self.environments = dict(environments)
        self.tracer = tracer or trace.get_tracer("agentgym.rollout")
        self.channels = RunChannels(config.run)
        self.stats = WorkerStats()
        self._inflight: set[asyncio.Task[None]] = set()
        self._served_version = -1
        self._version_lock = asyncio.Lock()

    async def wait_for_version(self, version: int) -> None:
        """Return once inference serves `version` or newer; TimeoutError after `version_wait_s`."""
        if self._served_version >= version:
            return
        deadline = asyncio.get_running_loop().time() + self.config.version_wait_s
        delay = 0.05
        while True:
            async with self._version_lock:  # one poller for all episodes waiting on the same update
                if self._served_version < version:
                    with contextlib.suppress(PolicyError):
                        self._served_version = max(self._served_version, await self.policy.served_version())
            if self._served_version >= version:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"inference still serves policy version {self._served_version} < {version}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve requests until `stop` is set, then shut down gracefully."""
        nc = await nats.connect(self.config.nats_url, name=f"rollout-{self.config.run}")
        js = nc.jetstream()
        try:
            subscription = await js.pull_subscribe(
                self.channels.requests_subject,
                durable=self.config.durable,
                stream=self.channels.requests_stream,
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.config.ack_wait_s),
            )
            while not stop.is_set():
                free = self.config.concurrency - len(self._inflight)
                if free <= 0:
                    await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
                    continue
                try:
                    messages = await subscription.fetch(free, timeout=0.5)
                except (TimeoutError, NatsTimeoutError):
                    continue
                for message in messages:
                    task = asyncio.create_task(self._handle(js, message))
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)
            await self._drain()
        finally:
            # nats-py's drain waits up to 30 s by default; the supervisor's stop timeout is 30 s too.
            try:
                await asyncio.wait_for(nc.drain(), timeout=self.config.shutdown_grace_s / 2)
            except TimeoutError:
                log.warning("NATS drain timed out; closing the connection")
                await nc.close()

    async def _drain(self) -> None:
        if not self._inflight:
            return
        log.info(
            "shutting down: waiting up to %.0fs for %d episodes", self.config.shutdown_grace_s, len(self._inflight)
        )
        _, pending = await asyncio.wait(set(self._inflight), timeout=self.config.shutdown_grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _handle(self, js: nats.js.JetStreamContext, message: Msg) -> None:
        self.stats.received += 1
        try:
            request = decode_message(message.data, rl_pb2.RolloutRequest)
        except Exception as error:
            log.error("dropping an undecodable rollout request: %s", error)
            self.stats.rejected += 1
            await message.term()
            return
        env = self.environments.get(request.environment)
        if env is None:
            log.error(
                "request %s names environment %r, which this worker does not serve",
                request.request_id,
                request.environment,
            )
            self.stats.rejected += 1
            await message.nak(delay=5)
            return
        heartbeat = asyncio.create_task(self._keep_alive(message))
        parent = extract_context(dict(message.headers or {}))
        try:
            await self.wait_for_version(request.policy_version)
            # One consumer span per request (child of the trainer's publish span when it sent one); the
            # episode's spans hang below it and the trajectory carries its context on to the trainer.
            with self.tracer.start_as_current_span(
                "process rollout_request",
                context=parent,
                kind=trace.SpanKind.CONSUMER,
                attributes={"messaging.system": "nats", "agentgym.request_id": request.request_id},
            ):
                trajectory = await run_episode(
                    request,
                    env,
                    self.policy,
                    self.chat,
                    template_for(request.environment),
                    self.config.settings,
                    self.tracer,
                )
                await publish_message(
                    js,
                    self.channels.trajectories_subject,
                    trajectory,
                    msg_id=trajectory.trajectory_id,
                    headers=inject_context(),
                )
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await message.nak()
            raise
        except Exception as error:  # version wait or publishing failed: leave it for redelivery
            log.warning("request %s not completed, handing it back: %s", request.request_id, error)
            with contextlib.suppress(Exception):
                await message.nak(delay=1)
            return
        finally:
            heartbeat.cancel()
        await message.ack()
        self.stats.published += 1
        name = rl_pb2.Termination.Name(trajectory.termination)
        self.stats.by_termination[name] = self.stats.by_termination.get(name, 0) + 1
        if trajectory.termination == rl_pb2.TERMINATION_ERROR:
            self.stats.failed_episodes += 1
        log.debug("trajectory %s", trajectory_summary(trajectory))

    async def _keep_alive(self, message: Msg) -> None:
        while True:
            await asyncio.sleep(max(self.config.ack_wait_s / 3, 0.5))
            with contextlib.suppress(Exception):
                await message.in_progress()
