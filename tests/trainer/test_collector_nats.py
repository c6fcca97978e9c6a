"""TrajectoryCollector against a real nats-server: dedup, staleness, groups, ack-after-commit, crash/restart."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import nats
import pytest
from nats.aio.client import Client
from trainer_helpers import synthetic_trajectory

from agentgym.messaging import EmbeddedNats, RunChannels, ensure_run_streams, publish_message
from agentgym.proto import rl_pb2
from agentgym.trainer.checkpoint import RecentIds
from agentgym.trainer.collector import TrajectoryCollector

Connect = Callable[[], Awaitable[Client]]


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats-collector")) as server:
        yield server


@pytest.fixture
async def connect(nats_server: EmbeddedNats) -> AsyncIterator[Connect]:
    clients: list[Client] = []

    async def make() -> Client:
        client = await nats.connect(nats_server.url)
        clients.append(client)
        return client

    yield make
    for client in clients:
        if not client.is_closed:
            await client.close()


def group(run: str, step: int, g: int, size: int, version: int) -> list[rl_pb2.Trajectory]:
    rng = random.Random(f"{run}/{step}/{g}")
    return [
        synthetic_trajectory(rng, run=run, step=step, group=g, sample=s, policy_version=version) for s in range(size)
    ]


async def publish(js: nats.js.JetStreamContext, channels: RunChannels, trajectories: list[rl_pb2.Trajectory]) -> None:
    for t in trajectories:
        await publish_message(js, channels.trajectories_subject, t, msg_id=t.trajectory_id)


async def consumer(js: nats.js.JetStreamContext, channels: RunChannels) -> nats.js.api.ConsumerInfo:
    return await js.consumer_info(channels.trajectories_stream, "trainer")


async def test_duplicates_and_stale_are_dropped_and_counted(connect: Connect) -> None:
    client = await connect()
    js = client.jetstream()
    channels = RunChannels("dedup-stale")
    await ensure_run_streams(js, channels)
    current = group("dedup-stale", 1, 0, 4, version=1)
    stale = group("dedup-stale", 0, 1, 4, version=0)
    await publish(js, channels, current + stale)
    # the same trajectory published again outside the duplicate window (no msg id): a second message
    await publish_message(js, channels.trajectories_subject, current[0])
    # a trajectory trained on before a restart (its id is in the restored checkpoint)
    old = group("dedup-stale", 1, 2, 1, version=1)[0]
    await publish(js, channels, [old])

    collector = TrajectoryCollector(js, channels, group_size=4, seen=RecentIds(ids=[old.trajectory_id]), ack_wait_s=30)
    await collector.start()
    batch = await collector.collect(n_groups=1, policy_version=1, timeout_s=5)
    assert [t.trajectory_id for t in batch.trajectories] == [t.trajectory_id for t in current]
    assert batch.groups == ["dedup-stale/1/0"]
    assert not batch.timed_out
    # wait for the rest (nothing else completes) so every message has been seen
    more = await collector.collect(n_groups=1, policy_version=1, timeout_s=1.0)
    counts = {k: batch.counts.get(k, 0) + more.counts.get(k, 0) for k in {*batch.counts, *more.counts}}
    assert counts["duplicates_dropped"] == 2
    assert counts["stale_dropped"] == 4
    assert more.trajectories == []
    acked = await collector.commit()
    assert acked == 4 + 2 + 4
    info = await consumer(js, channels)
    assert info.num_ack_pending == 0 and info.num_pending == 0
    await collector.close()


async def test_bounded_staleness_uses_recent_versions(connect: Connect) -> None:
    client = await connect()
    js = client.jetstream()
    channels = RunChannels("async-rl")
    await ensure_run_streams(js, channels)
    await publish(js, channels, group("async-rl", 0, 0, 2, version=3) + group("async-rl", 0, 1, 2, version=1))
    collector = TrajectoryCollector(js, channels, group_size=2, max_staleness=1, ack_wait_s=30)
    await collector.start()
    batch = await collector.collect(n_groups=2, policy_version=4, timeout_s=1.5)
    assert batch.groups == ["async-rl/0/0"]  # version 3 is 1 behind: used; version 1 is 3 behind: stale
    assert batch.counts["stale_dropped"] == 2
    await collector.close()


async def test_incomplete_groups_after_timeout(connect: Connect) -> None:
    client = await connect()
    js = client.jetstream()
    channels = RunChannels("partial")
    await ensure_run_streams(js, channels)
    await publish(js, channels, group("partial", 0, 0, 3, version=0) + group("partial", 0, 1, 1, version=0))
    collector = TrajectoryCollector(js, channels, group_size=4, ack_wait_s=30, min_group_size=2)
    await collector.start()
    batch = await collector.collect(n_groups=2, policy_version=0, timeout_s=1.5)
    assert batch.timed_out
    assert batch.groups == ["partial/0/0"] and len(batch.trajectories) == 3
    assert batch.counts["incomplete_groups_used"] == 1
    assert collector.buffered_groups == {"partial/0/1": 1}
    # the missing members arrive: the group completes at the next collect
    await publish(js, channels, group("partial", 0, 1, 4, version=0)[1:])
    later = await collector.collect(n_groups=1, policy_version=0, timeout_s=5)
    assert later.groups == ["partial/0/1"] and len(later.trajectories) == 4
    # a lone member stays buffered at version 0, and is dropped as stale once the policy moves on
    await publish(js, channels, group("partial", 0, 2, 1, version=0))
    waiting = await collector.collect(n_groups=1, policy_version=0, timeout_s=1.0)
    assert waiting.trajectories == [] and collector.buffered_groups == {"partial/0/2": 1}
    moved_on = await collector.collect(n_groups=1, policy_version=1, timeout_s=0.5)
    assert moved_on.counts["stale_groups_dropped"] == 1 and collector.buffered_groups == {}
    assert await collector.commit() == 3 + 4 + 1
    await collector.close()


async def test_ack_only_after_commit_and_redelivery_after_crash(connect: Connect) -> None:
    run = "crash"
    channels = RunChannels(run)
    setup = await connect()
    js = setup.jetstream()
    await ensure_run_streams(js, channels)
    first = group(run, 0, 0, 4, version=0)
    await publish(js, channels, first)
    ids = [t.trajectory_id for t in first]

    # trainer A: collects, trains (ids recorded as seen), dies before its checkpoint: no commit
    checkpointed_ids: list[str] = []
    client_a = await connect()
    seen_a = RecentIds(ids=checkpointed_ids)
    collector_a = TrajectoryCollector(client_a.jetstream(), channels, group_size=4, ack_wait_s=1.0, seen=seen_a)
    await collector_a.start()
    batch_a = await collector_a.collect(n_groups=1, policy_version=0, timeout_s=5)
    assert [t.trajectory_id for t in batch_a.trajectories] == ids
    seen_a.update(ids)  # what train_step does
    info = await consumer(js, channels)
    assert info.num_ack_pending == 4  # held, not acked
    await asyncio.sleep(1.6)  # longer than ack_wait: the in-progress heartbeats keep them
    info = await consumer(js, channels)
    assert info.num_redelivered == 0 and info.num_ack_pending == 4
    await client_a.close()  # crash: no commit, heartbeats stop

    # trainer B restarts from the last checkpoint (before that step): the same trajectories come back
    client_b = await connect()
    seen_b = RecentIds(ids=checkpointed_ids)
    collector_b = TrajectoryCollector(client_b.jetstream(), channels, group_size=4, ack_wait_s=1.0, seen=seen_b)
    await collector_b.start()
    batch_b = await collector_b.collect(n_groups=1, policy_version=0, timeout_s=10)
    assert [t.trajectory_id for t in batch_b.trajectories] == ids
    assert batch_b.counts.get("duplicates_dropped", 0) == 0
    seen_b.update(ids)
    checkpointed_ids = seen_b.to_list()  # step checkpointed ...
    assert await collector_b.commit() == 4  # ... then acked
    info = await consumer(js, channels)
    assert info.num_ack_pending == 0 and info.num_pending == 0

    # the next step: trainer B checkpoints, then dies before acking
    second = group(run, 1, 0, 4, version=1)
    await publish(js, channels, second)
    batch_b2 = await collector_b.collect(n_groups=1, policy_version=1, timeout_s=5)
    assert len(batch_b2.trajectories) == 4
    seen_b.update(t.trajectory_id for t in batch_b2.trajectories)
    checkpointed_ids = seen_b.to_list()
    await client_b.close()

    # trainer C resumes from that checkpoint: the redelivered trajectories are duplicates, used 0 times
    client_c = await connect()
    collector_c = TrajectoryCollector(
        client_c.jetstream(), channels, group_size=4, ack_wait_s=1.0, seen=RecentIds(ids=checkpointed_ids)
    )
    await collector_c.start()
    batch_c = await collector_c.collect(n_groups=1, policy_version=2, timeout_s=3)
    assert batch_c.trajectories == []
    assert batch_c.counts["duplicates_dropped"] == 4
    assert await collector_c.commit() == 4
    info = await consumer(js, channels)
    assert info.num_ack_pending == 0 and info.num_pending == 0
    await collector_c.close()


async def test_undecodable_message_is_terminated(connect: Connect) -> None:
    client = await connect()
    js = client.jetstream()
    channels = RunChannels("garbage")
    await ensure_run_streams(js, channels)
    await js.publish(channels.trajectories_subject, b"\xff\x00not a protobuf\xff")
    collector = TrajectoryCollector(js, channels, group_size=2, ack_wait_s=30)
    await collector.start()
    batch = await collector.collect(n_groups=1, policy_version=0, timeout_s=1.0)
    assert batch.counts["undecodable"] == 1 and batch.trajectories == []
    await asyncio.sleep(0.2)
    info = await consumer(js, channels)
    assert info.num_ack_pending == 0
    await collector.close()


async def test_infrastructure_failures_are_rerequested_and_their_retries_complete_the_group(connect: Connect) -> None:
    """An episode that the platform ended (TERMINATION_ERROR) is asked for again, not trained on; the retry
    fills its place in the group. Past ``max_rerequests`` it is kept as a failed member (the trainer leaves
    those out of the loss), so the group completes; the policy's failures stay data."""
    client = await connect()
    js = client.jetstream()
    channels = RunChannels("infra")
    await ensure_run_streams(js, channels)
    members = group("infra", 3, 0, 4, version=2)
    members[1].termination = rl_pb2.TERMINATION_ERROR
    members[1].termination_reason = "environment service unreachable: ClientConnectorError"
    members[2].termination = rl_pb2.TERMINATION_HORIZON  # the policy's own failure: data
    members[2].success = False
    asked: list[tuple[str, int]] = []

    async def rerequest(trajectory: rl_pb2.Trajectory, attempt: int) -> None:
        asked.append((trajectory.trajectory_id, attempt))
        retry = rl_pb2.Trajectory()
        retry.CopyFrom(trajectory)
        retry.trajectory_id = retry.request_id = f"{members[1].trajectory_id}/retry{attempt}"
        # The first retry fails again, the second plays through.
        retry.termination = rl_pb2.TERMINATION_ERROR if attempt == 1 else rl_pb2.TERMINATION_DONE
        await publish(js, channels, [retry])

    collector = TrajectoryCollector(js, channels, group_size=4, ack_wait_s=30, rerequest=rerequest, max_rerequests=3)
    await collector.start()
    await publish(js, channels, members)
    batch = await collector.collect(n_groups=1, policy_version=2, timeout_s=10)
    assert asked == [(members[1].trajectory_id, 1), (f"{members[1].trajectory_id}/retry1", 2)]
    ids = [t.trajectory_id for t in batch.trajectories]
    assert ids == [
        members[0].trajectory_id,
        f"{members[1].trajectory_id}/retry2",
        *(m.trajectory_id for m in members[2:]),
    ]
    assert all(t.termination != rl_pb2.TERMINATION_ERROR for t in batch.trajectories)
    assert batch.counts["infra_rerequested"] == 2 and "infra_gave_up" not in batch.counts
    assert await collector.commit() == 6  # the four used and the two failed ones: none redelivered
    await collector.close()

    # Past the cap, the failed episode is a member as it is: its group completes.
    capped_channels = RunChannels("infra-cap")
    await ensure_run_streams(js, capped_channels)
    capped = group("infra-cap", 4, 1, 2, version=2)
    capped[0].trajectory_id = capped[0].request_id = "infra-cap/4/1/0/retry3"
    capped[0].termination = rl_pb2.TERMINATION_ERROR
    collector = TrajectoryCollector(
        js, capped_channels, group_size=2, ack_wait_s=30, rerequest=rerequest, max_rerequests=3
    )
    await collector.start()
    asked.clear()
    await publish(js, capped_channels, capped)
    batch = await collector.collect(n_groups=1, policy_version=2, timeout_s=5)
    assert asked == [] and batch.counts["infra_gave_up"] == 1 and not batch.timed_out
    assert [t.trajectory_id for t in batch.trajectories] == [capped[0].trajectory_id, capped[1].trajectory_id]
    await collector.close()


def test_rerequest_ids_count_their_attempts() -> None:
    from agentgym.trainer.collector import original_request_id, rerequest_attempt

    assert rerequest_attempt("run/3/0/1") == 0 and original_request_id("run/3/0/1") == "run/3/0/1"
    assert rerequest_attempt("run/3/0/1/retry2") == 2 and original_request_id("run/3/0/1/retry2") == "run/3/0/1"
