"""Helpers of the trainer tests: synthetic multi-turn trajectories, engine-exact sampled logprobs, a scripted
rollout worker."""

from __future__ import annotations

import asyncio
import importlib.util
import random
from pathlib import Path
from typing import Any

import nats
import torch
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig

from agentgym.messaging import RunChannels, decode_message, ensure_run_streams, publish_message
from agentgym.proto import rl_pb2

UPDATE_GAP_BOUND = 1e-4
"""The largest ``update_gap`` between two float32 implementations of the same AdamW steps (see there)."""


def update_gap(start: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """How far apart two trainings of the same steps from ``start`` end: ``||a - b||_2 / ||a - start||_2``
    over all weights (sums in float64).

    Why a relative L2 gap and not the largest element gap: two float32 paths of the same update (another
    summation order in a matmul, DeepSpeed's ZeRO-3 linear, a fused AdamW kernel, AVX2 against AVX512
    kernels) differ in the gradients by rounding, ~1e-7 to 1e-6 of each element. AdamW divides by
    ``sqrt(v) + eps``: where an element's moments nearly cancel (a gradient near eps, or a second step's
    gradient against the first's momentum), that rounding is amplified without bound, up to the element's
    whole step (lr). With millions of weights a few such elements always exist, so the largest gap is
    luck: 2.6e-6 on AVX2 and 1.9e-5 under ``ATEN_CPU_CAPABILITY=default`` for the same ZeRO-3 run, 3.6e-5
    on an AVX512 Xeon, against a 1e-5 bound. In the L2 norm those few elements weigh what they are: the
    gap stays ~sqrt(rounding), measured 2.7e-6 to 8.5e-6 (ZeRO-2 and ZeRO-3, both kernel families), so
    ``UPDATE_GAP_BOUND`` (1e-4) is 10x above it. A wrong gradient is not rounding: the ZeRO-3 bug where a
    mini-batch learned from its last packed row only moved weights 7.7e-3 away (more than the 4e-3 the
    steps moved), a gap of order 1.
    """
    assert a.keys() == b.keys() == start.keys()
    gap = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    moved = sum(float((a[k].double() - start[k].double()).pow(2).sum()) for k in a)
    return float((gap / moved) ** 0.5)


def synthetic_trajectory(
    rng: random.Random,
    *,
    run: str = "test",
    step: int = 0,
    group: int = 0,
    sample: int = 0,
    environment: str = "textcraft",
    policy_version: int = 0,
    success: bool | None = None,
    termination: int | None = None,
    turns: int | None = None,
    vocab: tuple[int, int] = (200, 20000),
) -> rl_pb2.Trajectory:
    """A multi-turn trajectory with random ids: actions (mask 1) and observations (mask 0) alternating."""
    prompt = [rng.randrange(*vocab) for _ in range(rng.randint(8, 14))]
    response: list[int] = []
    mask: list[int] = []
    n_turns = turns if turns is not None else rng.randint(1, 3)
    trajectory_turns = []
    for k in range(n_turns):
        turn = rl_pb2.Turn(action_start=len(response))
        action = [rng.randrange(*vocab) for _ in range(rng.randint(3, 6))]
        response += action
        mask += [1] * len(action)
        turn.action_end = len(response)
        if k < n_turns - 1:
            observation = [rng.randrange(*vocab) for _ in range(rng.randint(2, 5))]
            response += observation
            mask += [0] * len(observation)
        turn.observation_end = len(response)
        turn.action = f"action {k}"
        trajectory_turns.append(turn)
    won = rng.random() < 0.5 if success is None else success
    if termination is None:
        termination = rl_pb2.TERMINATION_DONE if won else rl_pb2.TERMINATION_HORIZON
    group_id = f"{run}/{step}/{group}"
    return rl_pb2.Trajectory(
        run=run,
        trajectory_id=f"{group_id}/{sample}",
        request_id=f"{group_id}/{sample}",
        step=step,
        group_id=group_id,
        sample_index=sample,
        task_id=f"task-{group}",
        environment=environment,
        policy_version=policy_version,
        horizon=n_turns,
        prompt_token_ids=prompt,
        response_token_ids=response,
        loss_mask=mask,
        sampled_logprobs=[-2.0 if m else 0.0 for m in mask],
        turns=trajectory_turns,
        final_score=1.0 if won else 0.0,
        success=won,
        turns_used=n_turns,
        termination=termination,  # type: ignore[arg-type]
    )


def fill_logprobs(model: torch.nn.Module, trajectories: list[rl_pb2.Trajectory]) -> None:
    """Set sampled_logprobs to the model's own log-probs (what an exact inference engine reports)."""
    from agentgym.trainer.packing import response_logprobs_unpacked

    with torch.no_grad():
        for t in trajectories:
            ids = list(t.prompt_token_ids) + list(t.response_token_ids)
            lp = response_logprobs_unpacked(model, ids, len(t.prompt_token_ids)).tolist()
            del t.sampled_logprobs[:]
            t.sampled_logprobs.extend([v if m else 0.0 for v, m in zip(lp, t.loss_mask, strict=True)])


def load_benchmark(script: str, module_name: str | None = None) -> Any:
    """The module of ``benchmarks/<script>`` (benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / script
    spec = importlib.util.spec_from_file_location(module_name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def fake_rollout_worker(
    url: str, run: str, stop: asyncio.Event, requests_seen: list[rl_pb2.RolloutRequest]
) -> None:
    """Answers each RolloutRequest with a synthetic trajectory carrying the request's ids and version.

    The first trajectory is also published a second time without a message id (a worker that
    crashed after publishing and replayed the request): the trainer must drop it by id.
    """
    client = await nats.connect(url)
    js = client.jetstream()
    channels = RunChannels(run)
    await ensure_run_streams(js, channels)  # the operator's job in a cluster; the worker may start first
    subscription = await js.pull_subscribe(
        channels.requests_subject,
        durable="rollout-workers",
        stream=channels.requests_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30),
    )
    replayed = False
    try:
        while not stop.is_set():
            try:
                messages = await subscription.fetch(16, timeout=0.3)
            except (TimeoutError, NatsTimeoutError):
                continue
            for message in messages:
                request = decode_message(message.data, rl_pb2.RolloutRequest)
                requests_seen.append(request)
                rng = random.Random(request.seed)
                trajectory = synthetic_trajectory(
                    rng, run=run, environment=request.environment, policy_version=request.policy_version
                )
                trajectory.trajectory_id = trajectory.request_id = request.request_id
                trajectory.group_id, trajectory.step = request.group_id, request.step
                trajectory.sample_index, trajectory.task_id = request.sample_index, request.task_id
                trajectory.horizon = request.max_turns
                await publish_message(js, channels.trajectories_subject, trajectory, msg_id=trajectory.trajectory_id)
                if not replayed:
                    await publish_message(js, channels.trajectories_subject, trajectory)
                    replayed = True
                await message.ack()
    finally:
        await client.close()
