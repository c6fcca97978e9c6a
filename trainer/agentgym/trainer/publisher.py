"""What the trainer publishes: the RolloutRequests of a step, WeightUpdate and CurriculumState.

``RequestPublisher.plan(step, horizons, policy_version)`` is a pure function of the run's seed and
the step (``horizons``: max turns per environment, or one for all): ``tasks_per_step`` task slots; slot ``k``
picks an environment by weight, then a task uniformly from that environment's split (its catalog:
``environment_class(name).catalog()`` in-process, or the env service's ``GET /v1/tasks`` when the environment
has a ``url``), without repeats inside one step while the split has unused tasks. Each slot becomes a group
``group_id = "{run}/{step}/{k}"`` of ``group_size`` requests with
``request_id = "{run}/{step}/{k}/{sample}"`` (also the trajectory id the rollout worker gives the
trajectory). The request id is the JetStream ``Nats-Msg-Id``: a re-publish after a trainer crash
(same seed, same step: the same ids) is dropped by the stream's duplicate window, and a late one
produces trajectories the trainer drops as duplicates.

Control messages go to the run's control subjects with ids ``"{run}/weights/{version}"`` and
``"{run}/curriculum/{step}"``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from agentgym.messaging import RunChannels, publish_message
from agentgym.proto import rl_pb2
from agentgym.seeding import derive_seed
from agentgym.telemetry import inject_context
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.curriculum import CurriculumState

__all__ = [
    "RequestPublisher",
    "ServiceCatalog",
    "curriculum_message",
    "publish_curriculum",
    "publish_weight_update",
    "weight_update_message",
]

CatalogSource = Callable[[str], Any]


def _local_catalog(environment: str) -> Any:
    from agentgym.envs import environment_class

    return environment_class(environment).catalog()


class ServiceCatalog:
    """The task catalog of a running environment service (``GET /v1/tasks``), read once and cached."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url
        self.timeout = timeout
        self._splits: dict[str, int] | None = None
        self._ids: dict[str, list[str]] = {}

    def splits(self) -> dict[str, int]:
        if self._splits is None:
            from agentgym.envs.client import EnvClient

            with EnvClient(self.url, timeout=self.timeout) as client:
                self._splits = dict(client.splits())
        return dict(self._splits)

    def task_id(self, split: str, index: int) -> str:
        if split not in self._ids:
            from agentgym.envs.client import EnvClient

            size = self.splits().get(split, 0)
            ids: list[str] = []
            with EnvClient(self.url, timeout=self.timeout) as client:
                while len(ids) < size:
                    page = client.task_ids(split, offset=len(ids), limit=1000)
                    if not page:
                        break
                    ids.extend(page)
            self._ids[split] = ids
        return self._ids[split][index]


class RequestPublisher:
    """Plans and publishes each step's RolloutRequests (see the module docstring)."""

    def __init__(
        self,
        config: RLTrainerConfig,
        js: JetStreamContext | None = None,
        channels: RunChannels | None = None,
        *,
        catalogs: Mapping[str, Any] | CatalogSource | None = None,
    ) -> None:
        self.config = config
        self.js = js
        self.channels = channels or RunChannels(config.run)
        if catalogs is None:
            remote = {e.name: ServiceCatalog(e.url) for e in config.environments if e.url}
            self._catalog: CatalogSource = lambda name: remote[name] if name in remote else _local_catalog(name)
        elif callable(catalogs):
            self._catalog = catalogs
        else:
            table = dict(catalogs)
            self._catalog = table.__getitem__
        self._sizes: dict[tuple[str, str], int] = {}

    def _split_size(self, environment: str, split: str) -> int:
        key = (environment, split)
        if key not in self._sizes:
            splits = self._catalog(environment).splits()
            if split not in splits or splits[split] < 1:
                raise ValueError(f"{environment} has no tasks in split {split!r} (splits: {splits})")
            self._sizes[key] = int(splits[split])
        return self._sizes[key]

    def plan(self, step: int, horizons: int | Mapping[str, int], policy_version: int) -> list[rl_pb2.RolloutRequest]:
        """The requests of ``step`` (deterministic in ``(seed, run, step)``); ``horizons``: each environment's max
        turns (``RLTrainer.horizons_at``), or one for all."""
        c = self.config
        if isinstance(horizons, int):
            horizons = {e.name: horizons for e in c.environments}
        rng = random.Random(f"{c.seed}/{c.run}/{step}")
        envs = c.environments
        weights = [e.weight for e in envs]
        used: dict[str, set[int]] = {}
        requests = []
        for k in range(c.tasks_per_step):
            env = rng.choices(envs, weights=weights)[0]
            size = self._split_size(env.name, env.split)
            taken = used.setdefault(env.name, set())
            if len(taken) >= size:
                taken.clear()
            index = rng.randrange(size)
            while index in taken:
                index = rng.randrange(size)
            taken.add(index)
            task_id = self._catalog(env.name).task_id(env.split, index)
            group_id = f"{c.run}/{step}/{k}"
            for sample in range(c.group_size):
                requests.append(
                    rl_pb2.RolloutRequest(
                        run=c.run,
                        request_id=f"{group_id}/{sample}",
                        step=step,
                        environment=env.name,
                        task_id=task_id,
                        group_id=group_id,
                        sample_index=sample,
                        group_size=c.group_size,
                        max_turns=horizons[env.name],
                        policy_version=policy_version,
                        max_tokens_per_turn=c.max_tokens_per_turn,
                        temperature=c.temperature,
                        top_p=c.top_p,
                        seed=derive_seed(c.seed, c.run, step, k, sample),
                    )
                )
        return requests

    async def publish(
        self, step: int, horizons: int | Mapping[str, int], policy_version: int
    ) -> list[rl_pb2.RolloutRequest]:
        """Plan and publish the requests of ``step``; returns them."""
        if self.js is None:
            raise RuntimeError("RequestPublisher needs a JetStream context to publish")
        requests = self.plan(step, horizons, policy_version)
        headers = inject_context()  # the episodes hang under the current span (the train step) in one trace
        for request in requests:
            await publish_message(
                self.js, self.channels.requests_subject, request, msg_id=request.request_id, headers=headers
            )
        return requests

    async def rerequest(self, trajectory: rl_pb2.Trajectory, attempt: int, horizon: int) -> rl_pb2.RolloutRequest:
        """Ask again for the episode an infrastructure fault ended: the same task, group, sample, seed, horizon
        and policy version as its request, as ``<request id>/retry<attempt>``."""
        from agentgym.trainer.collector import RETRY_SUFFIX, original_request_id

        if self.js is None:
            raise RuntimeError("RequestPublisher needs a JetStream context to publish")
        original = original_request_id(trajectory.request_id or trajectory.trajectory_id)
        parts = original.rsplit("/", 2)  # "{run}/{step}/{k}/{sample}": the run may hold no "/"
        k, sample = int(parts[-2]), int(parts[-1])
        c = self.config
        request = rl_pb2.RolloutRequest(
            run=c.run,
            request_id=f"{original}{RETRY_SUFFIX}{attempt}",
            step=int(trajectory.step),
            environment=trajectory.environment,
            task_id=trajectory.task_id,
            group_id=trajectory.group_id,
            sample_index=sample,
            group_size=c.group_size,
            max_turns=int(trajectory.horizon) or horizon,  # the horizon it was asked with
            policy_version=int(trajectory.policy_version),
            max_tokens_per_turn=c.max_tokens_per_turn,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=derive_seed(c.seed, c.run, int(trajectory.step), k, sample),
        )
        await publish_message(
            self.js, self.channels.requests_subject, request, msg_id=request.request_id, headers=inject_context()
        )
        return request


def weight_update_message(run: str, version: int, path: str | Path, step: int) -> rl_pb2.WeightUpdate:
    uri = f"file://{Path(path).resolve()}"  # not as_uri(): readers strip "file://" without unquoting
    return rl_pb2.WeightUpdate(
        run=run, version=version, uri=uri, step=step, format="hf-safetensors", created_at=time.time()
    )


def curriculum_message(run: str, state: CurriculumState) -> rl_pb2.CurriculumState:
    message = rl_pb2.CurriculumState(
        run=run,
        step=state.step,
        stage=state.stage,
        horizon=state.horizon,
        schedule=state.schedule,
        updated_at=time.time(),
    )
    for key, value in state.metrics.items():
        message.metrics[key] = float(value)
    return message


async def publish_weight_update(
    js: JetStreamContext, channels: RunChannels, version: int, path: str | Path, step: int
) -> rl_pb2.WeightUpdate:
    message = weight_update_message(channels.run, version, path, step)
    await publish_message(js, channels.weights_subject, message, msg_id=f"{channels.run}/weights/{version}")
    return message


async def publish_curriculum(
    js: JetStreamContext, channels: RunChannels, state: CurriculumState
) -> rl_pb2.CurriculumState:
    message = curriculum_message(channels.run, state)
    await publish_message(js, channels.curriculum_subject, message, msg_id=f"{channels.run}/curriculum/{state.step}")
    return message
