"""The vLLM adapter's protocol, against a loopback fake that records requests and answers with the shapes of
vLLM's routes (checked against the real vLLM CPU server in test_vllm_cpu.py), and the platform's vLLM launch line
(`agentgym.plan.inference_server`) on CPU and GPU."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from agentgym.inference.client import CompletionClient, InferenceError
from agentgym.inference.vllm import ParamInfo, VLLMAdapter
from agentgym.messaging import free_port
from agentgym.plan import Placement, inference_server
from agentgym.spec import TrainingRun


class FakeVLLM:
    """Records (method, path, query, body) and answers like vLLM's OpenAI + dev-mode RLHF routes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, str], Any]] = []
        self.weight_version: str | None = None
        self.fail: set[str] = set()
        self.token_ids_field = True
        self.broadcast_done = asyncio.Event()
        self.wait_for_broadcast = False
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner = web.AppRunner(app)

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.calls]

    async def handle(self, request: web.Request) -> web.Response:
        text = await request.text()
        body = json.loads(text) if text else None
        path = request.path
        self.calls.append((request.method, path, dict(request.query), body))
        if path in self.fail:
            return web.json_response({"detail": f"{path} failed"}, status=500)
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model"}]})
        if path == "/v1/completions":
            return web.json_response(self.completion(body or {}))
        if path == "/weight_info":
            return web.json_response({"weight_version": self.weight_version})
        if path in ("/pause", "/resume"):
            return web.json_response({"status": "paused" if path == "/pause" else "resumed"})
        if path == "/is_paused":
            return web.json_response({"is_paused": False})
        if path == "/get_world_size":
            return web.json_response({"world_size": 2})
        if path == "/init_weight_transfer_engine":
            if body is None or "init_info" not in body:
                return web.json_response({"detail": "Missing 'init_info' in request body"}, status=400)
            return web.json_response({"message": "Weight transfer initialized"})
        if path == "/start_weight_update":
            return web.json_response({"message": "Weight update started"})
        if path == "/update_weights":
            if body is None or "update_info" not in body:
                return web.json_response({"detail": "Missing 'update_info' in request body"}, status=400)
            if self.wait_for_broadcast:  # NCCL: the workers receive while the trainer broadcasts
                await asyncio.wait_for(self.broadcast_done.wait(), 5)
            return web.json_response({"message": "Weights updated"})
        if path == "/finish_weight_update":
            if body and body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            return web.json_response({"message": "Weight update finished"})
        return web.json_response({"detail": "Not Found"}, status=404)

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for index in range(body.get("n", 1)):
            ids = [100 + index, 101, 2][: body["max_tokens"]]
            choice: dict[str, Any] = {
                "index": index,
                "text": "ab",
                "logprobs": {
                    "text_offset": list(range(len(ids))),
                    "token_logprobs": [-0.5, -1.0, -0.25][: len(ids)],
                    "tokens": [f"token_id:{t}" for t in ids],
                    "top_logprobs": None,
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            if self.token_ids_field:
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = body["prompt"]
            choices.append(choice)
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": choices,
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 3, "total_tokens": 0},
        }


@pytest.fixture
async def fake() -> AsyncIterator[FakeVLLM]:
    server = FakeVLLM()
    await server.start()
    yield server
    await server.runner.cleanup()


def vllm_run(**inference: object) -> TrainingRun:
    return TrainingRun.model_validate(
        {
            "apiVersion": "agentgym.io/v1alpha1",
            "kind": "TrainingRun",
            "metadata": {"name": "r"},
            "spec": {
                "model": {"name": "Qwen/Qwen2.5-7B-Instruct", "maxContextTokens": 8192},
                "environments": [{"name": "babyai"}],
                "inference": {"engine": "vllm", **inference},
            },
        }
    )


def test_the_launch_line_on_gpus_and_on_cpu() -> None:
    placement = Placement(spec_path="-", nats_url="-", inference_url="-", env_urls={}, http_ports={"inference": 8100})
    gpu = inference_server(
        vllm_run(tensorParallel=2, gpusPerReplica=2, gpuMemoryUtilization=0.7, maxBatchSize=128), placement
    )
    argv = list(gpu.command)
    # `python -m`: the `vllm` script's version lookup fails where the distribution is vllm-cpu.
    assert argv[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen2.5-7B-Instruct"]

    def flag(name: str, args: list[str] = argv) -> str:
        return args[args.index(name) + 1]

    assert flag("--served-model-name") == "Qwen/Qwen2.5-7B-Instruct"
    assert flag("--tensor-parallel-size") == "2" and flag("--gpu-memory-utilization") == "0.7"
    assert flag("--max-model-len") == "8192" and flag("--max-num-seqs") == "128" and flag("--port") == "8100"
    assert flag("--dtype") == "bfloat16"
    assert flag("--logprobs-mode") == "raw_logprobs"  # the trainer's semantics: before temperature / top-p
    assert flag("--generation-config") == "vllm"  # no sampling defaults from the checkpoint
    assert json.loads(flag("--weight-transfer-config")) == {"backend": "disk"}
    assert "--return-tokens-as-token-ids" in argv and "--enable-prefix-caching" in argv
    assert "--enforce-eager" not in argv
    assert gpu.env == {"VLLM_SERVER_DEV_MODE": "1"}

    cpu = inference_server(vllm_run(gpusPerReplica=0), placement)
    cpu_argv = list(cpu.command)
    assert "--enforce-eager" in cpu_argv and "--gpu-memory-utilization" not in cpu_argv
    assert "--no-enable-chunked-prefill" in cpu_argv and flag("--max-num-batched-tokens", cpu_argv) == "8192"
    assert "--no-enable-chunked-prefill" not in argv
    assert cpu.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    assert flag("--logprobs-mode", cpu_argv) == "raw_logprobs"

    plain = inference_server(vllm_run(), placement, weight_transfer_backend=None, extra_args=["--x"])
    assert "--weight-transfer-config" not in plain.command and plain.command[-1] == "--x"


async def test_completions_request_and_parsing(fake: FakeVLLM) -> None:
    async with CompletionClient(fake.url, engine="vllm") as client:
        completions = await client.complete([1, 2, 3], max_tokens=3, temperature=0.7, top_p=0.9, seed=5, n=2)
        fake.token_ids_field = False  # an older vLLM: ids recovered from 'token_id:N' logprob tokens
        [fallback] = await client.complete([1, 2, 3], max_tokens=2, stop=["\n"], stop_token_ids=[2])
    request = next(body for _, path, _, body in fake.calls if path == "/v1/completions")
    assert request == {
        "model": "policy",
        "prompt": [1, 2, 3],
        "max_tokens": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 2,
        "stop": None,
        "stop_token_ids": None,
        "seed": 5,
        "logprobs": 0,
        "return_token_ids": True,
    }
    assert [c.token_ids for c in completions] == [[100, 101, 2], [101, 101, 2]]
    assert completions[0].logprobs == [-0.5, -1.0, -0.25]
    assert completions[0].finish_reason == "stop" and completions[0].policy_version == 0
    assert fallback.token_ids == [100, 101]
    last = [body for _, path, _, body in fake.calls if path == "/v1/completions"][-1]
    assert last["stop"] == ["\n"] and last["stop_token_ids"] == [2]


async def test_reload_from_a_checkpoint_folder(fake: FakeVLLM) -> None:
    fake.weight_version = "default"  # what vLLM reports before any committed update
    async with CompletionClient(fake.url, engine="vllm", model="policy") as client:
        assert await client.policy_version() == 0
        assert await client.load_weights("file:///ckpt/step-3", 3) == 3
        assert await client.policy_version() == 3
        [completion] = await client.complete([1], max_tokens=1)
        assert completion.policy_version == 3  # vLLM sends none: the last version the client saw
        assert await client.load_weights("/ckpt/step-4", 4) == 4
    update = [(m, p, q, b) for m, p, q, b in fake.calls if p not in ("/weight_info", "/v1/completions")]
    assert update == [
        ("POST", "/pause", {"mode": "wait"}, None),
        ("POST", "/init_weight_transfer_engine", {}, {"init_info": {}}),
        ("POST", "/start_weight_update", {}, None),
        ("POST", "/update_weights", {}, {"update_info": {"path": "/ckpt/step-3"}}),
        ("POST", "/finish_weight_update", {}, {"weight_version": "3"}),
        ("POST", "/resume", {}, None),
        ("POST", "/pause", {"mode": "wait"}, None),
        ("POST", "/start_weight_update", {}, None),
        ("POST", "/update_weights", {}, {"update_info": {"path": "/ckpt/step-4"}}),
        ("POST", "/finish_weight_update", {}, {"weight_version": "4"}),
        ("POST", "/resume", {}, None),
    ]


async def test_a_failed_update_stays_paused_and_says_so(fake: FakeVLLM) -> None:
    fake.fail.add("/update_weights")
    async with VLLMAdapter(fake.url) as adapter:
        with pytest.raises(InferenceError, match="stays paused") as caught:
            await adapter.load_weights("/ckpt/bad", 5)
        assert caught.value.status == 500
        assert "/resume" not in fake.paths()
        with pytest.raises(InferenceError, match="absolute"):
            await adapter.load_weights("relative/dir", 6)
        assert await adapter.policy_version() == 0
        fake.fail.clear()
        assert await adapter.load_weights("/ckpt/good", 6) == 6
    assert fake.paths()[-1] == "/resume"


async def test_nccl_control_plane(fake: FakeVLLM) -> None:
    fake.wait_for_broadcast = True
    params = [ParamInfo("model.embed_tokens.weight", "torch.bfloat16", (49152, 576)), ParamInfo("x", "float32", (3,))]
    order: list[str] = []
    loop = asyncio.get_running_loop()

    def broadcast() -> None:  # stands in for the trainer's rank-0 NCCL broadcast (runs in a thread)
        deadline = time.monotonic() + 5
        while "/update_weights" not in fake.paths() and time.monotonic() < deadline:
            time.sleep(0.01)
        order.append(f"broadcast after {fake.paths()[-1]}")
        loop.call_soon_threadsafe(fake.broadcast_done.set)

    async with VLLMAdapter(fake.url) as adapter:
        assert await adapter.world_size() == 2
        await adapter.init_nccl("10.0.0.5", 29500, world_size=3)
        assert await adapter.update_nccl(params, broadcast, version=7) == 7
        assert await adapter.policy_version() == 7
    _, _, _, init = next(c for c in fake.calls if c[1] == "/init_weight_transfer_engine")
    assert init == {
        "init_info": {
            "master_address": "10.0.0.5",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 3,
            "packed": True,
            "packed_buffer_size_bytes": 1 << 30,
            "packed_num_buffers": 2,
        }
    }
    _, _, _, update = next(c for c in fake.calls if c[1] == "/update_weights")
    assert update == {
        "update_info": {
            "names": ["model.embed_tokens.weight", "x"],
            "dtype_names": ["bfloat16", "float32"],
            "shapes": [[49152, 576], [3]],
        }
    }
    # update_weights was in flight (blocked on the rendezvous) while the broadcast ran.
    assert order == ["broadcast after /update_weights"]
    tail = [p for p in fake.paths() if p not in ("/weight_info", "/get_world_size", "/init_weight_transfer_engine")]
    assert tail == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]
