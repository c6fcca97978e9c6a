"""The trainer job end to end over a real nats-server, with a scripted rollout worker; then a resume."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from trainer_helpers import fake_rollout_worker

from agentgym.messaging import EmbeddedNats, RunChannels, decode_message, ensure_run_streams
from agentgym.proto import rl_pb2
from agentgym.trainer.checkpoint import checkpoint_dirs
from agentgym.trainer.loop import run_training
from agentgym.trainer.main_thread import MainThreadExecutor, run_loop_beside
from agentgym.trainer.trainer import RLTrainer, StepMetrics


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats-loop")) as server:
        yield server


async def control_messages(url: str, run: str) -> tuple[list[rl_pb2.WeightUpdate], list[rl_pb2.CurriculumState]]:
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        channels = RunChannels(run)
        weights, curriculum = [], []
        sub = await js.subscribe(f"{channels.prefix}.control.>", ordered_consumer=True)
        with contextlib.suppress(TimeoutError, NatsTimeoutError):
            while True:
                msg = await sub.next_msg(timeout=0.5)
                if msg.subject == channels.weights_subject:
                    weights.append(decode_message(msg.data, rl_pb2.WeightUpdate))
                else:
                    curriculum.append(decode_message(msg.data, rl_pb2.CurriculumState))
        return weights, curriculum
    finally:
        await client.close()


async def test_training_loop_end_to_end_and_resume(
    nats_server: EmbeddedNats, config_factory: Callable[..., Any]
) -> None:
    run = "loop"
    config = config_factory(
        run=run,
        total_steps=3,
        tasks_per_step=2,
        group_size=2,
        checkpoint_every=2,
        collect_timeout_s=20,
        ack_wait_s=10,
        curriculum={"kind": "scaling_inter", "horizons": [3, 5], "stage_steps": 2},
    )
    stop = asyncio.Event()
    seen_requests: list[rl_pb2.RolloutRequest] = []
    worker = asyncio.create_task(fake_rollout_worker(nats_server.url, run, stop, seen_requests))
    steps: list[StepMetrics] = []
    try:
        trainer = await asyncio.wait_for(run_training(config, nats_server.url, on_step=steps.append), 120)
    finally:
        stop.set()
        await worker
    assert [m.step for m in steps] == [0, 1, 2]
    assert trainer.step == 3 and trainer.policy_version == 3
    assert [m.counts["used"] for m in steps] == [4, 4, 4]
    assert sum(m.counts.get("duplicates_dropped", 0) for m in steps) == 1
    assert [m.horizon for m in steps] == [3, 3, 5]  # ScalingInter: a new stage at step 2
    horizons = {r.step: r.max_turns for r in seen_requests}
    versions = {r.step: r.policy_version for r in seen_requests}
    assert horizons == {0: 3, 1: 3, 2: 5} and versions == {0: 0, 1: 1, 2: 2}
    assert [n for n, _ in checkpoint_dirs(config.checkpoint_dir)] == [2, 3]  # every 2 steps and the last
    assert (config.weights_dir / "version-1").is_dir()  # step 1: weights-only export

    weights, curriculum = await control_messages(nats_server.url, run)
    assert [w.version for w in weights] == [0, 1, 2, 3]
    assert weights[0].uri.endswith(config.model.rstrip("/").split("/")[-1])  # the initial model
    assert weights[-1].uri.endswith("checkpoints/step-3")
    assert [(c.step, c.horizon, c.stage) for c in curriculum] == [(0, 3, 0), (1, 3, 0), (2, 5, 1), (3, 5, 1)]
    lines = (config.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]

    client = await nats.connect(nats_server.url)
    try:
        info = await client.jetstream().consumer_info(RunChannels(run).trajectories_stream, "trainer")
        assert info.num_ack_pending == 0 and info.num_pending == 0  # everything used was acked
    finally:
        await client.close()

    # a new trainer process with more steps resumes at step 3
    trainer.close()
    more = config_factory(**{**config.to_dict(), "total_steps": 4, "environments": config.environments})
    stop = asyncio.Event()
    worker = asyncio.create_task(fake_rollout_worker(nats_server.url, run, stop, seen_requests))
    resumed_steps: list[StepMetrics] = []
    try:
        resumed = await asyncio.wait_for(run_training(more, nats_server.url, on_step=resumed_steps.append), 120)
    finally:
        stop.set()
        await worker
    assert [m.step for m in resumed_steps] == [3]
    assert resumed.step == 4 and resumed_steps[0].horizon == 5
    assert {r.step for r in seen_requests} == {0, 1, 2, 3}
    resumed.close()


async def test_stop_while_waiting_for_trajectories(
    nats_server: EmbeddedNats, config_factory: Callable[..., Any]
) -> None:
    config = config_factory(run="idle", total_steps=2, tasks_per_step=1, group_size=2, collect_timeout_s=600)
    stop = asyncio.Event()
    stopped_at: list[float] = []

    async def stop_once_waiting() -> None:
        client = await nats.connect(nats_server.url)
        js = client.jetstream()
        channels = RunChannels("idle")
        await ensure_run_streams(js, channels)
        while (await js.stream_info(channels.requests_stream)).state.messages == 0:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # the trainer is now inside collect()
        stopped_at.append(asyncio.get_running_loop().time())
        stop.set()
        await client.close()

    stopper = asyncio.create_task(stop_once_waiting())
    trainer = await asyncio.wait_for(run_training(config, nats_server.url, stop=stop), 60)
    await stopper
    assert asyncio.get_running_loop().time() - stopped_at[0] < 10  # not the 600 s collect timeout
    assert trainer.step == 0 and list(config.checkpoint_dir.glob("step-*")) == []
    trainer.close()


def test_the_trainer_process_computes_on_the_main_thread_in_the_loops_context(
    nats_server: EmbeddedNats, config_factory: Callable[..., Any]
) -> None:
    # As the trainer entrypoint runs it: the loop in another thread, each step on the main thread, with the
    # loop's context (its current span) carried into the call, as asyncio.to_thread carried it.
    run = "main-thread"
    config = config_factory(run=run, total_steps=1, tasks_per_step=2, group_size=2, collect_timeout_s=20, ack_wait_s=10)
    trainer = RLTrainer(config)
    probe: contextvars.ContextVar[str] = contextvars.ContextVar("probe")
    calls: list[tuple[bool, str]] = []
    train_step = trainer.train_step

    def recorded_step(*args: Any, **kwargs: Any) -> StepMetrics:
        calls.append((threading.current_thread() is threading.main_thread(), probe.get("not carried")))
        return train_step(*args, **kwargs)

    trainer.train_step = recorded_step  # type: ignore[method-assign]
    executor = MainThreadExecutor()

    async def main(stop: asyncio.Event) -> RLTrainer:
        probe.set("the loop's")
        worker_stop = asyncio.Event()
        worker = asyncio.create_task(fake_rollout_worker(nats_server.url, run, worker_stop, []))
        try:
            return await asyncio.wait_for(
                run_training(config, nats_server.url, stop=stop, trainer=trainer, compute=executor), 120
            )
        finally:
            worker_stop.set()
            await worker

    try:
        assert run_loop_beside(main, executor, stop_signals=()) is trainer
        assert trainer.step == 1 and calls == [(True, "the loop's")]
    finally:
        trainer.close()
