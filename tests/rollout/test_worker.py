"""The rollout worker on a real nats-server: requests in, trajectories out, acks only after publishing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from agentgym.envs.client import AsyncEnvClient
from agentgym.inference.client import CompletionClient
from agentgym.messaging import EmbeddedNats, RunChannels, decode_message, ensure_run_streams, publish_message
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import EpisodeSettings
from agentgym.rollout.policy import InferencePolicy
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.rollout.worker import RolloutWorker, WorkerConfig
from agentgym.telemetry import inject_context, setup_telemetry


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        yield server


def rollout_request(run: str, n: int) -> rl_pb2.RolloutRequest:
    return rl_pb2.RolloutRequest(
        run=run,
        request_id=f"{run}/0/{n}/0",
        step=0,
        environment="babyai",
        task_id=f"GoToRedBall/s{n}",
        group_id=f"{run}/0/{n}",
        max_turns=2,
        max_tokens_per_turn=8,
        temperature=1.0,
        top_p=1.0,
    )


async def test_requests_become_trajectories_and_are_acked(
    nats_server: EmbeddedNats, inference_url: str, babyai_url: str, chat: ChatTokenizer, tmp_path: Path
) -> None:
    run = "worker-e2e"
    channels = RunChannels(run)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_run_streams(js, channels)
    telemetry = setup_telemetry("test-trainer", directory=tmp_path, set_global=False)
    tracer = telemetry.tracer("test")
    with tracer.start_as_current_span("publish_requests"):
        headers = inject_context()
    for n in range(6):
        await publish_message(js, channels.requests_subject, rollout_request(run, n), headers=headers)
    await nc.publish(channels.requests_subject, b"\xff not a protobuf")  # must not wedge the worker
    await js.publish(channels.requests_subject, rollout_request(run, 20).SerializeToString())  # headerless is fine

    async with CompletionClient(inference_url) as client, AsyncEnvClient(babyai_url) as env:
        worker = RolloutWorker(
            WorkerConfig(run=run, nats_url=nats_server.url, concurrency=4, settings=EpisodeSettings()),
            InferencePolicy(client),
            chat,
            {"babyai": env},
            tracer=tracer,
        )
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        trajectories = await js.pull_subscribe(channels.trajectories_subject, durable="check")
        received: list[rl_pb2.Trajectory] = []
        while len(received) < 7:
            for message in await trajectories.fetch(7 - len(received), timeout=60):
                received.append(decode_message(message.data, rl_pb2.Trajectory))
                assert message.headers and "traceparent" in message.headers
                await message.ack()
        stop.set()
        await asyncio.wait_for(running, 30)

    assert sorted(t.trajectory_id for t in received) == sorted([f"{run}/0/{n}/0" for n in (*range(6), 20)])
    outcomes = [(rl_pb2.Termination.Name(t.termination), t.turns_used, t.termination_reason) for t in received]
    assert all(t.termination == rl_pb2.TERMINATION_HORIZON and t.turns_used == 2 for t in received), outcomes
    assert worker.stats.published == 7 and worker.stats.rejected == 1
    requests = await js.stream_info(channels.requests_stream)
    assert requests.state.messages == 0  # every request acked (work queue) or terminated
    telemetry.shutdown()
    await nc.close()


async def test_republished_trajectory_is_deduplicated(nats_server: EmbeddedNats) -> None:
    channels = RunChannels("dedup")
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_run_streams(js, channels)
    trajectory = rl_pb2.Trajectory(run="dedup", trajectory_id="dedup/0/0/0")
    for _ in range(3):  # a worker crashed after publishing, before acking: the request is replayed
        await publish_message(js, channels.trajectories_subject, trajectory, msg_id=trajectory.trajectory_id)
    assert (await js.stream_info(channels.trajectories_stream)).state.messages == 1
    await nc.close()


async def test_episodes_wait_until_inference_serves_the_requested_version(
    nats_server: EmbeddedNats, inference_url: str, babyai_url: str, chat: ChatTokenizer, tiny_dir: Path
) -> None:
    run = "version-gate"
    channels = RunChannels(run)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_run_streams(js, channels)
    async with CompletionClient(inference_url) as client, AsyncEnvClient(babyai_url) as env:
        served = await client.policy_version()
        ahead = rollout_request(run, 1)
        ahead.policy_version = served + 1
        await publish_message(js, channels.requests_subject, ahead)
        worker = RolloutWorker(
            WorkerConfig(run=run, nats_url=nats_server.url, concurrency=2),
            InferencePolicy(client),
            chat,
            {"babyai": env},
        )
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        trajectories = await js.pull_subscribe(channels.trajectories_subject, durable="check")
        with pytest.raises(nats.errors.TimeoutError):
            await trajectories.fetch(1, timeout=1.5)  # not before the new weights are served
        await client.load_weights(str(tiny_dir), served + 1)
        [message] = await trajectories.fetch(1, timeout=60)
        trajectory = decode_message(message.data, rl_pb2.Trajectory)
        assert trajectory.policy_version == served + 1 and trajectory.termination == rl_pb2.TERMINATION_HORIZON
        stop.set()
        await asyncio.wait_for(running, 30)
    await nc.close()


@pytest.mark.slow
async def test_a_request_in_play_stays_with_its_worker_and_a_killed_workers_goes_to_another(
    nats_server: EmbeddedNats, inference_url: str, babyai_url: str, chat: ChatTokenizer, tiny_dir: Path, tmp_path: Path
) -> None:
    """Heartbeats keep a request with its worker past the ack wait; once that worker is SIGKILLed, JetStream
    hands the request to another worker after the ack wait (WorkerConfig.ack_wait_s), which plays it."""
    run = "handover"
    channels = RunChannels(run)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_run_streams(js, channels)
    defaults = WorkerConfig(run=run, nats_url=nats_server.url)
    ack_wait, durable = defaults.ack_wait_s, defaults.durable  # the consumer every worker of the run shares
    async with CompletionClient(inference_url) as client, AsyncEnvClient(babyai_url) as env:
        served = await client.policy_version()
        held = rollout_request(run, 1)
        held.policy_version = served + 1  # waits for weights that are loaded only after the kill
        await publish_message(js, channels.requests_subject, held)
        first = subprocess.Popen(
            [sys.executable, "-m", "agentgym.cli", "rollout", "worker", "--nats-url", nats_server.url,
             "--inference-url", inference_url, "--env-url", f"babyai={babyai_url}", "--run", run,
             "--tokenizer", "builtin:tiny", "--log-level", "warning"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,  # its telemetry/ lands in cwd
        )  # fmt: skip
        try:

            async def pending() -> int:
                try:
                    return int((await js.consumer_info(channels.requests_stream, durable)).num_ack_pending)
                except nats.js.errors.NotFoundError:
                    return 0

            deadline = time.monotonic() + 120
            while await pending() < 1:  # the first worker holds the request
                assert first.poll() is None and time.monotonic() < deadline, first.communicate()
                await asyncio.sleep(0.2)
            second = RolloutWorker(
                WorkerConfig(run=run, nats_url=nats_server.url, concurrency=2), InferencePolicy(client), chat,
                {"babyai": env},
            )  # fmt: skip
            stop = asyncio.Event()
            running = asyncio.create_task(second.run(stop))
            await asyncio.sleep(1.2 * ack_wait)
            info = await js.consumer_info(channels.requests_stream, durable)
            assert info.config.ack_wait == ack_wait
            assert info.num_redelivered == 0 and info.num_ack_pending == 1  # still the first worker's
            assert second.stats.published == 0
        finally:
            first.kill()
            first.wait()
        await client.load_weights(str(tiny_dir), served + 1)
        trajectories = await js.pull_subscribe(channels.trajectories_subject, durable="check")
        [message] = await trajectories.fetch(1, timeout=120)
        trajectory = decode_message(message.data, rl_pb2.Trajectory)
        assert trajectory.trajectory_id == held.request_id and trajectory.termination == rl_pb2.TERMINATION_HORIZON
        assert second.stats.published == 1
        # The ack is a plain publish, flushed after `message.ack()` returns: the server may apply it a moment later.
        deadline = time.monotonic() + 10
        while (await js.stream_info(channels.requests_stream)).state.messages != 0:  # acked by the second
            assert time.monotonic() < deadline, "the second worker's ack never reached the stream"
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(running, 30)
    await nc.close()
