"""The trainer's side of the trajectory stream: a durable JetStream pull consumer that assembles groups.

``TrajectoryCollector`` (durable consumer ``trainer`` on the run's trajectory stream):

* **Ack after checkpoint.** Every message is held unacked until :meth:`commit`, which the training
  loop calls only after the step that used it is checkpointed. While held, messages get an
  in-progress heartbeat every ``ack_wait / 3`` so JetStream does not redeliver them. If the trainer
  dies before ``commit``, JetStream redelivers them (after ``ack_wait``) to the next collector.
* **Dedup by trajectory id.** A trajectory whose id was trained on before (``seen``: the trainer's
  :class:`~agentgym.trainer.checkpoint.RecentIds`, restored from the checkpoint, so ids seen before
  a restart count), or is already buffered / handed out and not yet committed, is dropped and
  counted. Its message is acked at the next commit.
* **Staleness.** On-policy by default: only trajectories of the current policy version are used.
  With ``max_staleness = n`` a trajectory of version ``v`` is used at version ``V`` when
  ``V - n <= v <= V``. Others are dropped, counted as stale, and acked at the next commit; at each
  :meth:`collect` buffered groups that became stale are dropped the same way.
* **Groups.** Trajectories are buffered by ``group_id``; a group is complete with ``group_size``
  accepted trajectories (failed episodes count: the group is all back; the trainer excludes them
  from the loss). :meth:`collect` returns the first ``n_groups`` complete groups in order of
  completion. Timeout policy: when ``timeout_s`` passes first, incomplete groups holding at least
  ``min_group_size`` trajectories are used as they are (oldest first, counted as
  ``incomplete_groups_used``) to fill the batch; smaller ones stay buffered (their missing members
  may still come) until they complete or turn stale. A batch may hence be short, or empty when
  nothing usable arrived.
* **Infrastructure faults are re-requested, not trained on.** A trajectory that ended in
  ``TERMINATION_ERROR`` (an environment service or inference that died or timed out, an environment that
  raised: the platform's fault, not the policy's) is dropped, its message acked at the next commit, and
  ``rerequest(trajectory, attempt)`` asks for the same episode again as ``<request id>/retry<attempt>``
  (the loop waits 2, 4, 8, ... s first: a restarting service needs that long), up to ``max_rerequests``
  times. Past that the failed trajectory takes its place in the group as any failed episode does (the
  trainer leaves it out of the loss), so one dead part cannot stall the step. Counted as
  ``infra_rerequested`` and ``infra_gave_up``. The policy's own failures (invalid actions, the horizon,
  the context limit) are data as before.
* Undecodable messages are terminated (``term``) at once: redelivering them cannot help.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from agentgym.messaging import RunChannels, decode_message
from agentgym.proto import rl_pb2
from agentgym.trainer.checkpoint import RecentIds

log = logging.getLogger(__name__)

__all__ = ["CollectedBatch", "TrajectoryCollector", "original_request_id", "rerequest_attempt"]


@dataclass
class CollectedBatch:
    """Trajectories of whole groups for one step, and what was dropped while collecting them.

    ``counts`` (during this collect): ``messages`` decoded, ``duplicates_dropped``, ``stale_dropped``,
    ``stale_groups_dropped``, ``undecodable``, ``incomplete_groups_used``, ``infra_rerequested``,
    ``infra_gave_up``.
    """

    trajectories: list[rl_pb2.Trajectory] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False


@dataclass
class _Group:
    first_seen: float
    members: dict[str, tuple[rl_pb2.Trajectory, int]] = field(default_factory=dict)  # id -> (trajectory, seq)
    completed_at: float | None = None

    @property
    def version(self) -> int:
        return min(t.policy_version for t, _ in self.members.values())


RETRY_SUFFIX = "/retry"


def rerequest_attempt(request_id: str) -> int:
    """How many times the episode of ``request_id`` was re-requested before: ``…/retry2`` -> 2, ``…/3`` -> 0."""
    _, sep, tail = request_id.rpartition(RETRY_SUFFIX)
    return int(tail) if sep and tail.isdigit() else 0


def original_request_id(request_id: str) -> str:
    return request_id.rpartition(RETRY_SUFFIX)[0] if rerequest_attempt(request_id) else request_id


class TrajectoryCollector:
    """See the module docstring. ``await start()``, then ``collect`` / ``commit`` per step, ``close`` at the end."""

    def __init__(
        self,
        js: JetStreamContext,
        channels: RunChannels,
        *,
        group_size: int,
        max_staleness: int = 0,
        seen: RecentIds | None = None,
        durable: str = "trainer",
        ack_wait_s: float = 60.0,
        heartbeat_s: float | None = None,
        min_group_size: int = 2,
        fetch_batch: int = 64,
        max_ack_pending: int = 65536,
        rerequest: Callable[[rl_pb2.Trajectory, int], Awaitable[None]] | None = None,
        max_rerequests: int = 5,
    ) -> None:
        if group_size < 1 or min_group_size < 1:
            raise ValueError("group_size and min_group_size must be >= 1")
        self.js = js
        self.channels = channels
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.seen = seen if seen is not None else RecentIds()
        self.durable = durable
        self.ack_wait_s = ack_wait_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else max(ack_wait_s / 3.0, 0.2)
        self.min_group_size = min_group_size
        self.fetch_batch = fetch_batch
        self.max_ack_pending = max_ack_pending
        self.rerequest = rerequest
        self.max_rerequests = max_rerequests
        self._subscription: JetStreamContext.PullSubscription | None = None
        self._held: dict[int, Msg] = {}  # stream sequence -> latest delivery, until acked
        self._consumed: list[int] = []  # sequences to ack at the next commit
        self._pending_ids: set[str] = set()  # buffered or handed out, not yet committed
        self._uncommitted_ids: list[str] = []
        self._groups: dict[str, _Group] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future[None]] = set()
        self._counts: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            deliver_policy=DeliverPolicy.ALL,
            max_deliver=-1,
            max_ack_pending=self.max_ack_pending,
        )
        self._subscription = await self.js.pull_subscribe(
            self.channels.trajectories_subject,
            durable=self.durable,
            stream=self.channels.trajectories_stream,
            config=config,
        )
        self._heartbeat = asyncio.create_task(self._keep_alive())

    async def close(self) -> None:
        """Stop heartbeats and unsubscribe; uncommitted messages are NOT acked (they will be redelivered)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            for message in list(self._held.values()):
                with contextlib.suppress(Exception):
                    await message.in_progress()

    # ------------------------------------------------------------------------------------------

    @property
    def buffered_groups(self) -> dict[str, int]:
        """Group id -> trajectories buffered (not yet handed out)."""
        return {gid: len(g.members) for gid, g in self._groups.items()}

    @property
    def held_messages(self) -> int:
        return len(self._held)

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n

    def _usable(self, version: int, current: int) -> bool:
        return current - self.max_staleness <= version <= current

    def _consume(self, seq: int) -> None:
        if seq not in self._consumed:
            self._consumed.append(seq)

    def _drop_stale_groups(self, current: int) -> None:
        for gid in list(self._groups):
            group = self._groups[gid]
            if not self._usable(group.version, current):
                del self._groups[gid]
                for tid, (_, seq) in group.members.items():
                    self._consume(seq)
                    self._uncommitted_ids.append(tid)
                self._count("stale_dropped", len(group.members))
                self._count("stale_groups_dropped")

    def _accept(self, message: Msg, current: int) -> None:
        seq = int(message.metadata.sequence.stream)
        try:
            trajectory = decode_message(message.data, rl_pb2.Trajectory)
        except Exception as error:
            log.error("terminating an undecodable trajectory message (stream seq %d): %s", seq, error)
            self._held.pop(seq, None)
            self._count("undecodable")
            task = asyncio.ensure_future(message.term())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        self._count("messages")
        known = seq in self._held
        self._held[seq] = message
        tid = trajectory.trajectory_id or f"seq-{seq}"
        if tid in self.seen or tid in self._pending_ids:
            if not known:
                self._consume(seq)
            self._count("duplicates_dropped")
            return
        if not self._usable(trajectory.policy_version, current):
            self._consume(seq)
            self._pending_ids.add(tid)
            self._uncommitted_ids.append(tid)
            self._count("stale_dropped")
            return
        attempt = rerequest_attempt(tid) + 1
        if trajectory.termination == rl_pb2.TERMINATION_ERROR and self.rerequest is not None:
            if attempt > self.max_rerequests:
                self._count("infra_gave_up")
                log.warning("%s failed %d times (%s): kept as failed", tid, attempt, trajectory.termination_reason)
                self._add_to_group(trajectory, tid, seq)
                return
            self._consume(seq)
            self._pending_ids.add(tid)
            self._uncommitted_ids.append(tid)
            self._count("infra_rerequested")
            log.info("re-requesting %s: %s", tid, trajectory.termination_reason)
            task = asyncio.ensure_future(self.rerequest(trajectory, attempt))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        self._add_to_group(trajectory, tid, seq)

    def _add_to_group(self, trajectory: rl_pb2.Trajectory, tid: str, seq: int) -> None:
        self._pending_ids.add(tid)
        gid = trajectory.group_id or tid
        group = self._groups.setdefault(gid, _Group(first_seen=time.monotonic()))
        group.members[tid] = (trajectory, seq)
        if len(group.members) >= self.group_size and group.completed_at is None:
            group.completed_at = time.monotonic()

    def _complete(self) -> list[str]:
        done = [(g.completed_at, gid) for gid, g in self._groups.items() if g.completed_at is not None]
        return [gid for _, gid in sorted(done)]

    async def collect(self, n_groups: int, policy_version: int, timeout_s: float) -> CollectedBatch:
        """Up to ``n_groups`` groups usable at ``policy_version`` (see the module docstring)."""
        if self._subscription is None:
            raise RuntimeError("call start() first")
        self._counts = {}
        self._drop_stale_groups(policy_version)
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while len(self._complete()) < n_groups:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                messages = await self._subscription.fetch(self.fetch_batch, timeout=min(remaining, 1.0))
            except (TimeoutError, NatsTimeoutError):
                continue
            for message in messages:
                self._accept(message, policy_version)
        chosen = self._complete()[:n_groups]
        if len(chosen) < n_groups:
            partial = sorted(
                (g.first_seen, gid)
                for gid, g in self._groups.items()
                if g.completed_at is None and len(g.members) >= self.min_group_size
            )
            extra = [gid for _, gid in partial[: n_groups - len(chosen)]]
            self._count("incomplete_groups_used", len(extra))
            chosen += extra
        batch = CollectedBatch(groups=chosen, timed_out=timed_out)
        for gid in chosen:
            group = self._groups.pop(gid)
            for tid, (trajectory, seq) in sorted(group.members.items(), key=lambda kv: kv[1][0].sample_index):
                batch.trajectories.append(trajectory)
                self._consume(seq)
                self._uncommitted_ids.append(tid)
        batch.counts = dict(self._counts)
        return batch

    async def commit(self) -> int:
        """Ack every message handed out or dropped since the last commit (call after the checkpoint)."""
        acked = 0
        for seq in self._consumed:
            message = self._held.pop(seq, None)
            if message is None:
                continue
            try:
                await message.ack_sync(timeout=10)
            except NatsTimeoutError:
                await message.ack()
            acked += 1
        self._consumed.clear()
        self.seen.update(self._uncommitted_ids)
        self._pending_ids.difference_update(self._uncommitted_ids)
        self._uncommitted_ids.clear()
        return acked
