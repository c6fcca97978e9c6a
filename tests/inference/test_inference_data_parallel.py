"""Data-parallel replicas behind one front: the router's choices by hand, the merged metrics, when data parallelism
is refused, and `agentgym inference serve --data-parallel 2` as real processes (routing, weight loads, a replica
killed under load, the front stopped and killed)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from agentgym.cli.main import app
from agentgym.cpus import CPUS_VARIABLE, available_memory
from agentgym.inference import data_parallel
from agentgym.inference.data_parallel import (
    AFFINITY_SLACK,
    ROUTING_BLOCK,
    PrefixRouter,
    _routing_ids,
    _served_ids,
    data_parallel_refusal,
    merge_metrics,
    replica_arguments,
    replica_bytes,
)
from agentgym.inference.engine import DEFAULT_PREFIX_CACHE_BYTES, Engine, SamplingParams
from agentgym.inference.prefix_cache import block_keys
from agentgym.messaging import free_port
from agentgym.operator.manifests import Checkpoint
from agentgym.operator.weights import Replica, roller_for, sync_replicas

BLOCK = ROUTING_BLOCK


def blocks(token_ids: list[int], known: list[int] | None = None) -> list[int]:
    """The router's prefix block keys (`prefix_cache.block_keys` at `ROUTING_BLOCK`)."""
    return block_keys(token_ids, ROUTING_BLOCK, known=known or ())


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_routing_blocks_name_each_whole_block_prefix() -> None:
    first, second = tokens(0, BLOCK), tokens(100, BLOCK)
    assert blocks(first + second + first, blocks(first)) == blocks(first + second + first)
    assert blocks(first[:-1]) == []  # no whole block
    assert blocks(first + second + [7]) == blocks(first + second)  # a partial block is not named
    [one] = blocks(first)
    assert blocks(first + second)[0] == one
    assert blocks(second + second)[1] != blocks(first + second)[1]  # chained: the prefix counts


def test_router_prefers_the_longest_served_prefix_within_the_slack() -> None:
    router = PrefixRouter(3, slack=4)
    ready = [True, True, True]
    first, second, other = tokens(0, BLOCK), tokens(100, BLOCK), tokens(500, BLOCK)
    # nothing served yet: least loaded, lowest index
    assert router.choose(blocks(first + second), ready, [2, 1, 1]) == 1
    router.record(blocks(first + second), 0)
    # the first block's replica is now 2 (it served it last), the second's still 0
    router.record(blocks(first + other), 2)
    assert router.choose(blocks(first + second + [1, 2]), ready, [3, 0, 0]) == 0  # the longest prefix: 3 < 0 + 4
    assert router.choose(blocks(first + other), ready, [0, 0, 3]) == 2
    # only the first block matches
    assert router.choose(blocks(first + tokens(900, BLOCK)), ready, [0, 1, 1]) == 2
    # 4 more than the least loaded: balanced instead
    assert router.choose(blocks(first + second), ready, [4, 0, 0]) == 1
    assert router.choose(blocks(tokens(0, BLOCK - 1)), ready, [1, 0, 0]) == 1  # shorter than a block: by load
    assert router.choose([], ready, [0, 1, 0]) == 0  # a text prompt (no blocks): by load


def test_router_skips_replicas_that_are_not_ready_and_forgets_restarted_ones() -> None:
    router = PrefixRouter(2, slack=AFFINITY_SLACK)
    prompt = tokens(0, 3 * BLOCK)
    router.record(blocks(prompt), 1)
    assert router.choose(blocks(prompt), [True, False], [5, 0]) == 0
    assert router.choose(blocks(prompt), [False, False], [0, 0]) is None
    assert router.choose(blocks(prompt), [True, True], [1, 2]) == 1
    router.forget(1)  # restarted: its prefix cache is empty
    assert router.choose(blocks(prompt), [True, True], [1, 2]) == 0


def test_router_forgets_the_least_recently_served_blocks_beyond_its_capacity() -> None:
    router = PrefixRouter(2, capacity=2)
    old, new = tokens(0, 2 * BLOCK), tokens(1000, 2 * BLOCK)
    router.record(blocks(old), 1)
    router.record(blocks(new), 1)  # 4 blocks recorded, the 2 of `old` forgotten
    assert router.choose(blocks(old), [True, True], [0, 0]) == 0
    assert router.choose(blocks(new), [True, True], [0, 0]) == 1


def test_routing_ids_of_each_prompt_shape() -> None:
    assert _routing_ids({"prompt": [5, 6], "n": 3}) == ([[5, 6]], 3)
    assert _routing_ids({"prompt": [[5], [6, 7]]}) == ([[5], [6, 7]], 2)
    assert _routing_ids({"prompt": [[5], "text"]}) == ([], 2)  # not all token ids: by load
    assert _routing_ids({"prompt": ["a", "b"], "n": 2}) == ([], 4)
    assert _routing_ids({"prompt": "text"}) == ([], 1)
    assert _routing_ids({"prompt": [5], "n": "many"}) == ([[5]], 1)  # the replica answers the 400
    assert _routing_ids(["not", "an", "object"]) == ([], 1)


def test_served_ids_continue_each_prompts_blocks() -> None:
    prompts = [tokens(0, BLOCK + 5), tokens(300, 2 * BLOCK)]
    prompt_blocks = [blocks(prompt) for prompt in prompts]
    sampled = [tokens(700, 20), tokens(800, 3), tokens(900, BLOCK)]
    choices = [  # n = 2 for the first prompt's two choices ... as the server numbers them: index // n is the prompt
        {"index": 0, "prompt_token_ids": prompts[0], "token_ids": sampled[0]},
        {"index": 1, "prompt_token_ids": prompts[0], "token_ids": sampled[1]},
        {"index": 2, "prompt_token_ids": prompts[1], "token_ids": sampled[2]},
        {"index": 3, "prompt_token_ids": prompts[1], "token_ids": None},  # no ids returned: nothing recorded
    ]
    served = _served_ids(json.dumps({"choices": choices}).encode(), prompt_blocks)
    assert served == [
        blocks(prompts[0] + sampled[0]),
        blocks(prompts[0] + sampled[1]),
        blocks(prompts[1] + sampled[2]),
    ]
    assert len(served[0]) == 2 and len(served[1]) == 1 and len(served[2]) == 3
    assert _served_ids(b"not json", prompt_blocks) == []


def test_replica_arguments_repeat_the_given_options() -> None:
    options = {"max_batch_size": 16, "dtype": "bfloat16", "num_threads": None, "prefix_cache_tokens": 0}
    assert replica_arguments("builtin:tiny", options) == [
        "--model", "builtin:tiny", "--max-batch-size", "16", "--dtype", "bfloat16", "--prefix-cache-tokens", "0",
    ]  # fmt: skip


def test_data_parallel_is_refused_on_gpus_and_beyond_the_memory(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert data_parallel_refusal(str(tiny_dir), 1, "cuda", None) is None
    assert "CPU engines" in str(data_parallel_refusal(str(tiny_dir), 2, "cuda", None))
    monkeypatch.setenv(CPUS_VARIABLE, "2")
    assert "a core of its own, and this process may use 2" in str(data_parallel_refusal(str(tiny_dir), 3, "cpu", 0))
    monkeypatch.setenv(CPUS_VARIABLE, "4")
    one = replica_bytes(str(tiny_dir), None)
    weights = sum(path.stat().st_size for path in tiny_dir.glob("*.safetensors"))
    assert one == 2 * weights + DEFAULT_PREFIX_CACHE_BYTES
    # 4 layers x 2 (keys, values) x 2 kv heads x 64 x 4 bytes = 4 KiB a token
    assert replica_bytes(str(tiny_dir), 1000) == 2 * weights + 1000 * 4096
    monkeypatch.setattr(data_parallel, "available_memory", lambda: 3 * one)
    assert data_parallel_refusal(str(tiny_dir), 3, "cpu", None) is None
    refusal = data_parallel_refusal(str(tiny_dir), 4, "cpu", None)
    assert refusal is not None and "--data-parallel 4" in refusal and "GiB available" in refusal


def test_available_memory_is_capped_by_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert available_memory(meminfo, tmp_path) == 2048 * 1024
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("400000\n")
    assert available_memory(meminfo, tmp_path) == 600000
    (tmp_path / "memory.max").write_text("max\n")
    assert available_memory(meminfo, tmp_path) == 2048 * 1024
    assert available_memory(tmp_path / "absent", tmp_path / "absent") is None


def test_merge_metrics_labels_every_sample_with_its_replica() -> None:
    text = (
        "# HELP agentgym_inference_requests_total Completion requests by outcome\n"
        "# TYPE agentgym_inference_requests_total counter\n"
        'agentgym_inference_requests_total{status="ok"} {ok}\n'
        "# HELP agentgym_inference_running_sequences Sequences in the running batch\n"
        "# TYPE agentgym_inference_running_sequences gauge\n"
        "agentgym_inference_running_sequences {running}\n"
    )
    merged = merge_metrics(
        [
            ("0", text.replace("{ok}", "3.0").replace("{running}", "2.0")),
            ("1", text.replace("{ok}", "5.0").replace("{running}", "0.0")),
        ]
    )
    assert merged.count("# HELP agentgym_inference_requests_total") == 1
    families = {family.name: family for family in text_string_to_metric_families(merged)}
    requests = {s.labels["replica"]: s.value for s in families["agentgym_inference_requests"].samples}
    assert requests == {"0": 3.0, "1": 5.0}
    running = {s.labels["replica"]: s.value for s in families["agentgym_inference_running_sequences"].samples}
    assert running == {"0": 2.0, "1": 0.0}
    assert families["agentgym_inference_requests"].samples[0].labels["status"] == "ok"


# ---------------------------------------------------------------------------------------------------- processes


class Front:
    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log


@pytest.fixture
def front(tiny_dir: Path, tmp_path: Path) -> Iterator[Front]:
    """`agentgym inference serve --data-parallel 2` (float32, so that an in-process engine can check its answers)."""
    port = free_port()
    command = [sys.executable, "-m", "agentgym.cli", "inference", "serve", "--model", str(tiny_dir), "--port",
               str(port), "--data-parallel", "2", "--max-batch-size", "16", "--dtype", "float32", "--log-level",
               "warning"]  # fmt: skip
    log = tmp_path / "front.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, env={**os.environ, CPUS_VARIABLE: "2"}, stderr=output, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, "the front exited while starting"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the front did not become healthy"
        time.sleep(0.3)
    try:
        yield Front(process, url, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def requests_by_replica(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
    counts: dict[str, float] = {}
    for family in families:
        if family.name == "agentgym_inference_requests":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("status") == "ok":
                    counts[sample.labels["replica"]] = sample.value
    return counts


def wait_for(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


def replicas_state(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/health", timeout=5).json()["replicas"]


@pytest.mark.slow
async def test_data_parallel_serve_routes_loads_and_survives_a_replica(
    front: Front, engine: Engine, other_tiny_dir: Path
) -> None:
    prompt = tokens(1, 3 * BLOCK + 5)
    greedy = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 0, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=front.url, timeout=120) as client:
        # The same answer as one engine, and the same prompt served where its prefix is (the first replica).
        expected = await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
        for _ in range(3):
            response = await client.post("/v1/completions", json=greedy)
            assert response.status_code == 200 and response.headers["x-policy-version"] == "0"
            [choice] = response.json()["choices"]
            assert choice["token_ids"] == expected.samples[0].token_ids
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected.samples[0].logprobs, abs=1e-4)
        assert requests_by_replica(front.url) == {"0": 3.0}
        # Twenty at once: the first AFFINITY_SLACK (16) where the prefix is, the rest to the other replica.
        long = {"prompt": prompt, "max_tokens": 48, "ignore_eos": True, "return_token_ids": True}
        answers = await asyncio.gather(*(client.post("/v1/completions", json=long) for _ in range(20)))
        assert [a.status_code for a in answers] == [200] * 20
        assert requests_by_replica(front.url) == {"0": 3.0 + AFFINITY_SLACK, "1": 20.0 - AFFINITY_SLACK}

        # Weights: every replica or none; the front checks the body as one server does.
        async with aiohttp.ClientSession() as session:  # the weight roll of `agentgym run` and of the operator
            rolled = await sync_replicas(
                roller_for("hf", session, timeout=120),
                [Replica("inference", front.url, 0)],
                Checkpoint(2, str(other_tiny_dir)),
            )
        assert rolled.served == 2 and rolled.reloaded == ["inference"] and not rolled.failed
        assert [r["policy_version"] for r in replicas_state(front.url)] == [2, 2]
        missing = await client.post("/v1/load_weights", json={"uri": "/nonexistent", "version": 3})
        assert missing.status_code == 400 and "still serving policy version 2" in missing.json()["error"]["message"]
        stale = await client.post("/v1/load_weights", json={"uri": str(other_tiny_dir), "version": 1})
        assert stale.status_code == 409
        invalid = await client.post("/v1/load_weights", json={"uri": "", "version": 4})
        assert invalid.status_code == 400 and "uri" in invalid.json()["error"]["message"]
        assert [r["policy_version"] for r in replicas_state(front.url)] == [2, 2]
        async with (  # the front's cap, answered before the body is read (aiohttp reads the answer regardless)
            aiohttp.ClientSession() as session,
            session.post(f"{front.url}/v1/completions", data=b"[" + b"1," * (3 << 20) + b"1]") as huge,
        ):
            assert huge.status == 413 and (await huge.json())["error"]["code"] == 413
        bad = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]  # the replica's answer

        # A replica killed under load: its requests are served by the other, then it comes back on version 2.
        longer = {**long, "max_tokens": 256}
        pending = [asyncio.create_task(client.post("/v1/completions", json=longer)) for _ in range(8)]
        deadline = time.monotonic() + 30
        while not (busy := [r for r in (await client.get("/health")).json()["replicas"] if r["in_flight"]]):
            assert time.monotonic() < deadline, "the requests never reached a replica"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # generating
        os.kill(busy[0]["pid"], signal.SIGKILL)
        answers = await asyncio.gather(*pending)
        assert [a.status_code for a in answers] == [200] * 8
        assert all(len(a.json()["choices"][0]["token_ids"]) == 256 for a in answers)
        assert "failed under a request" in front.log.read_text()  # it held them: they were sent again
        killed = busy[0]["replica"]
        wait_for(lambda: all(r["ready"] for r in replicas_state(front.url)))
        states = replicas_state(front.url)
        assert [r["policy_version"] for r in states] == [2, 2]
        assert [r["restarts"] for r in states] == [int(r["replica"] == killed) for r in states]
        metrics = httpx.get(f"{front.url}/metrics", timeout=10).text
        assert f'agentgym_inference_replica_restarts_total{{replica="{killed}"}} 1' in metrics

    # SIGTERM: the front stops its replicas and exits cleanly.
    pids = [int(r["pid"]) for r in replicas_state(front.url)]
    front.process.send_signal(signal.SIGTERM)
    assert front.process.wait(timeout=60) == 0
    assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in pids)


@pytest.mark.slow
def test_replicas_exit_with_the_front(front: Front) -> None:
    pids = [int(r["pid"]) for r in replicas_state(front.url)]
    assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)
    front.process.kill()  # SIGKILL: no cleanup of its own, the parent-death signal stops the replicas
    front.process.wait()

    def gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in pids)

    wait_for(gone, timeout=60)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


@pytest.mark.parametrize(
    ("options", "code", "message"),
    [
        (["--data-parallel", "0"], 2, "--data-parallel"),
        (["--data-parallel", "2", "--device", "cuda"], 2, "data parallelism is for CPU engines"),
    ],
    ids=["zero", "gpu"],
)
def test_serve_refuses_bad_data_parallelism_before_starting(
    tiny_dir: Path, options: list[str], code: int, message: str
) -> None:
    result = CliRunner().invoke(app, ["inference", "serve", "--model", str(tiny_dir), *options])
    assert result.exit_code == code and message in result.output, result.output
