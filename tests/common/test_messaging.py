"""NATS helpers against a real nats-server with JetStream."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import yaml
from nats.js.api import RetentionPolicy
from nats.js.errors import NotFoundError

from agentgym.messaging import (
    TRAJECTORY_STREAM_BYTES,
    EmbeddedNats,
    RunChannels,
    decode_message,
    delete_run_streams,
    ensure_run_streams,
    publish_message,
)
from agentgym.proto import rl_pb2

ROOT = Path(__file__).resolve().parents[2]


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


class SizedNats(EmbeddedNats):
    """A nats-server whose JetStream file store is `max_file_store` bytes, as on a volume of that size."""

    def __init__(self, store_dir: Path, max_file_store: int) -> None:
        super().__init__(store_dir)
        self.max_file_store = max_file_store

    def argv(self) -> list[str]:
        config = self.store_dir.parent / "sized-nats.conf"
        config.write_text(f"jetstream {{ max_file_store: {self.max_file_store} }}\n")
        return [*super().argv(), "-c", str(config)]


def charts_nats_volume_bytes() -> int:
    values = yaml.safe_load((ROOT / "charts" / "agentgym" / "values.yaml").read_text())
    size = values["nats"]["config"]["jetstream"]["fileStore"]["pvc"]["size"]
    assert size.endswith("Gi"), size
    return int(size[:-2]) * 1024**3


async def test_many_runs_fit_on_the_charts_nats_volume_and_committed_trajectories_are_deleted(tmp_path: Path) -> None:
    # JetStream reserves every stream's max_bytes: with 4 GiB a run, a third run on the chart's volume was refused.
    volume = charts_nats_volume_bytes()
    assert volume == 10 * 1024**3
    with SizedNats(tmp_path / "store", volume) as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        runs = [RunChannels(f"run-{i}") for i in range(16)]
        for channels in runs:
            await ensure_run_streams(js, channels)
        assert volume // TRAJECTORY_STREAM_BYTES >= 16
        channels = runs[0]
        for i in range(3):
            trajectory = rl_pb2.Trajectory(run="run-0", trajectory_id=f"t-{i}", response_token_ids=[1, 2])
            await publish_message(js, channels.trajectories_subject, trajectory, msg_id=f"t-{i}")
        trainer = await js.pull_subscribe(channels.trajectories_subject, durable="trainer")
        messages = await trainer.fetch(3, timeout=2)
        assert (await js.stream_info(channels.trajectories_stream)).state.messages == 3  # held until committed
        for message in messages:
            await message.ack_sync()
        assert (await js.stream_info(channels.trajectories_stream)).state.messages == 0
        await nc.close()


async def test_streams_of_an_older_release_are_updated_in_place(js: nats.js.JetStreamContext) -> None:
    channels = RunChannels("older")
    trajectories = channels.stream_configs()[1]
    old = dataclasses.replace(trajectories, retention=RetentionPolicy.LIMITS, max_bytes=64 * 1024**2, discard=None)
    await js.add_stream(old)
    await ensure_run_streams(js, channels)  # no error: the retention cannot change, the rest is updated
    info = await js.stream_info(channels.trajectories_stream)
    assert info.config.retention == RetentionPolicy.LIMITS and info.config.max_bytes == 64 * 1024**2
    assert (await js.stream_info(channels.control_stream)).config.max_msgs_per_subject == 16
    await delete_run_streams(js, channels)


def test_embedded_server_persists_in_its_directory(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "store")
    url = server.start()
    assert url.startswith("nats://127.0.0.1:")
    server.stop()
    assert (tmp_path / "store" / "nats-server.log").exists()
    server.stop()  # twice is fine
