"""NATS helpers against a real nats-server with JetStream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.js.errors import NotFoundError

from agentgym.messaging import (
    EmbeddedNats,
    RunChannels,
    decode_message,
    delete_run_streams,
    ensure_run_streams,
    publish_message,
)
from agentgym.proto import rl_pb2


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture
async def js(nats_server: EmbeddedNats) -> AsyncIterator[nats.js.JetStreamContext]:
    nc = await nats.connect(nats_server.url)
    yield nc.jetstream()
    await nc.close()


def test_channels_are_named_per_run() -> None:
    channels = RunChannels("my-run.1")
    assert channels.requests_subject == "agentgym.my-run_1.rollout.requests"
    assert channels.trajectories_stream == "AGENTGYM_MY_RUN_1_TRAJECTORIES"
    with pytest.raises(ValueError):
        RunChannels("").prefix  # noqa: B018


async def test_streams_publish_dedup_and_cleanup(js: nats.js.JetStreamContext) -> None:
    channels = RunChannels("demo")
    await ensure_run_streams(js, channels)
    await ensure_run_streams(js, channels)  # idempotent
    trajectory = rl_pb2.Trajectory(run="demo", trajectory_id="t-1", response_token_ids=[5, 6, 7], loss_mask=[1, 1, 0])
    await publish_message(js, channels.trajectories_subject, trajectory, msg_id="t-1")
    await publish_message(js, channels.trajectories_subject, trajectory, msg_id="t-1")  # redelivery: dropped
    info = await js.stream_info(channels.trajectories_stream)
    assert info.state.messages == 1

    subscription = await js.pull_subscribe(channels.trajectories_subject, durable="trainer")
    [message] = await subscription.fetch(1, timeout=2)
    decoded = decode_message(message.data, rl_pb2.Trajectory)
    assert decoded == trajectory
    assert message.headers is not None and "agentgym.v1.Trajectory" in message.headers["Content-Type"]
    await message.ack()

    request = rl_pb2.RolloutRequest(run="demo", request_id="r-1", max_turns=6)
    await publish_message(js, channels.requests_subject, request)
    work = await js.pull_subscribe(channels.requests_subject, durable="workers")
    [job] = await work.fetch(1, timeout=2)
    await job.ack()

    deleted = await delete_run_streams(js, channels)
    assert sorted(deleted) == sorted([channels.requests_stream, channels.trajectories_stream, channels.control_stream])
    with pytest.raises(NotFoundError):
        await js.stream_info(channels.trajectories_stream)


def test_embedded_server_persists_in_its_directory(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "store")
    url = server.start()
    assert url.startswith("nats://127.0.0.1:")
    server.stop()
    assert (tmp_path / "store" / "nats-server.log").exists()
    server.stop()  # twice is fine
