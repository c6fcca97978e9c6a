"""RequestPublisher: deterministic task sampling, ids, weights; JetStream dedup of re-publishes; control messages."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from agentgym.messaging import EmbeddedNats, RunChannels, decode_message, ensure_run_streams
from agentgym.proto import rl_pb2
from agentgym.trainer.config import EnvironmentConfig, RLTrainerConfig
from agentgym.trainer.curriculum import CurriculumState
from agentgym.trainer.publisher import RequestPublisher, publish_curriculum, publish_weight_update


class FakeCatalog:
    def __init__(self, name: str, sizes: dict[str, int]) -> None:
        self.name = name
        self.sizes = sizes

    def splits(self) -> dict[str, int]:
        return dict(self.sizes)

    def task_id(self, split: str, index: int) -> str:
        assert 0 <= index < self.sizes[split]
        return f"{self.name}:{split}:{index}"


def _config(**kw: Any) -> RLTrainerConfig:
    values: dict[str, Any] = {
        "run": "pub",
        "seed": 7,
        "group_size": 3,
        "tasks_per_step": 4,
        "environments": [EnvironmentConfig("textcraft", "train", 3.0), EnvironmentConfig("babyai", "train", 1.0)],
        "tensorboard": False,
        "otel_metrics": False,
    }
    values.update(kw)
    return RLTrainerConfig(**values)


CATALOGS = {"textcraft": FakeCatalog("textcraft", {"train": 50}), "babyai": FakeCatalog("babyai", {"train": 30})}


def test_plan_is_deterministic_and_well_formed() -> None:
    publisher = RequestPublisher(_config(), catalogs=CATALOGS)
    requests = publisher.plan(step=5, horizons=13, policy_version=4)
    assert requests == RequestPublisher(_config(), catalogs=CATALOGS).plan(5, 13, 4)
    assert requests != publisher.plan(6, 13, 4)
    assert len(requests) == 4 * 3
    assert [r.request_id for r in requests[:3]] == ["pub/5/0/0", "pub/5/0/1", "pub/5/0/2"]
    groups = Counter(r.group_id for r in requests)
    assert groups == {f"pub/5/{k}": 3 for k in range(4)}
    for r in requests:
        assert (r.run, r.step, r.max_turns, r.policy_version, r.group_size) == ("pub", 5, 13, 4, 3)
        assert r.task_id.startswith(f"{r.environment}:train:")
        assert r.seed > 0
    by_group: dict[str, set[str]] = {}
    for r in requests:
        by_group.setdefault(r.group_id, set()).add(r.task_id)
    assert all(len(tasks) == 1 for tasks in by_group.values())  # a group is one task
    assert len({next(iter(t)) for t in by_group.values()}) == 4  # no task twice in a step
    assert len({r.seed for r in requests}) == len(requests)


def test_environments_are_sampled_by_weight() -> None:
    publisher = RequestPublisher(_config(group_size=2), catalogs=CATALOGS)
    picks = Counter(r.environment for step in range(300) for r in publisher.plan(step, 6, 0) if r.sample_index == 0)
    share = picks["textcraft"] / sum(picks.values())
    assert 0.70 < share < 0.80  # weight 3 : 1


def test_each_request_gets_its_environments_horizon() -> None:
    publisher = RequestPublisher(_config(), catalogs=CATALOGS)
    requests = publisher.plan(4, {"textcraft": 8, "babyai": 5}, 0)
    assert {r.environment for r in requests} == {"textcraft", "babyai"}
    assert all(r.max_turns == {"textcraft": 8, "babyai": 5}[r.environment] for r in requests)
    # The horizons change max_turns only: the tasks, ids and seeds are those of one horizon for all.
    same = publisher.plan(4, 6, 0)
    assert [(r.request_id, r.task_id, r.seed) for r in requests] == [(r.request_id, r.task_id, r.seed) for r in same]


def test_default_catalog_is_the_environment_catalog() -> None:
    from agentgym.envs import environment_class

    config = _config(environments=[EnvironmentConfig("textcraft", "test")])
    requests = RequestPublisher(config).plan(0, 10, 0)
    catalog = environment_class("textcraft").catalog()
    valid = set(catalog.task_ids("test"))
    assert all(r.task_id in valid for r in requests)
    with pytest.raises(ValueError, match="no tasks in split"):
        RequestPublisher(_config(environments=[EnvironmentConfig("textcraft", "nope")])).plan(0, 10, 0)


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats-publisher")) as server:
        yield server


async def test_republish_after_crash_is_dropped_and_control_messages(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    client = await nats.connect(nats_server.url)
    try:
        js = client.jetstream()
        channels = RunChannels("pub")
        await ensure_run_streams(js, channels)
        publisher = RequestPublisher(_config(), js, channels, catalogs=CATALOGS)
        first = await publisher.publish(step=0, horizons=6, policy_version=0)
        # the trainer restarts and publishes step 0 again: the same ids, dropped by the duplicate window
        again = await RequestPublisher(_config(), js, channels, catalogs=CATALOGS).publish(0, 6, 0)
        assert first == again
        info = await js.stream_info(channels.requests_stream)
        assert info.state.messages == len(first) == 12

        await publish_weight_update(js, channels, version=3, path=tmp_path, step=3)
        await publish_curriculum(
            js,
            channels,
            CurriculumState(step=3, stage=1, horizon=13, schedule="scaling_inter", metrics={"success_rate": 0.5}),
        )
        weights = await js.get_last_msg(channels.control_stream, channels.weights_subject)
        update = decode_message(weights.data or b"", rl_pb2.WeightUpdate)
        assert (update.version, update.step, update.format) == (3, 3, "hf-safetensors")
        assert update.uri == f"file://{tmp_path.resolve()}"
        curriculum = await js.get_last_msg(channels.control_stream, channels.curriculum_subject)
        state = decode_message(curriculum.data or b"", rl_pb2.CurriculumState)
        assert (state.step, state.stage, state.horizon, state.schedule) == (3, 1, 13, "scaling_inter")
        assert dict(state.metrics) == {"success_rate": 0.5}
    finally:
        await client.close()


def test_catalog_from_a_running_env_service() -> None:
    """With an environment url, tasks come from the service's GET /v1/tasks (same ids as in-process)."""
    from agentgym.cli.main import _local_service
    from agentgym.envs import environment_class
    from agentgym.trainer.publisher import ServiceCatalog

    local = environment_class("textcraft").catalog()
    with _local_service("textcraft") as url:
        remote = ServiceCatalog(url)
        assert remote.splits() == local.splits()
        assert [remote.task_id("test", i) for i in (0, 57, 99)] == [local.task_id("test", i) for i in (0, 57, 99)]
        config = _config(environments=[EnvironmentConfig("textcraft", "test", 1.0, url)])
        via_service = RequestPublisher(config).plan(3, 10, 0)
    in_process = RequestPublisher(_config(environments=[EnvironmentConfig("textcraft", "test")])).plan(3, 10, 0)
    assert [r.task_id for r in via_service] == [r.task_id for r in in_process]
