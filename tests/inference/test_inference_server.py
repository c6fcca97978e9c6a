"""The HTTP API (vLLM's completions subset + our weight routes) through a live server and CompletionClient."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from agentgym.inference.client import Completion, CompletionClient, InferenceError
from agentgym.inference.engine import Engine

Rescore = Callable[[torch.nn.Module, list[int], list[int]], list[float]]


async def post(url: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as response:
        return response.status, await response.json(), response.headers


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return await response.text()


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    match = re.search(pattern, text)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


async def test_client_returns_sampled_ids_logprobs_and_version(live_server: Any, rescore: Rescore) -> None:
    engine: Engine = live_server.engine
    prompt = list(engine.tokenizer.encode("go to the red door", add_special_tokens=False))
    async with CompletionClient(live_server.url) as client:
        [completion] = await client.complete(prompt, max_tokens=8, temperature=1.0, seed=1)
        samples = await client.complete(prompt, max_tokens=5, temperature=0.8, top_p=0.9, seed=2, n=3)
        assert await client.policy_version() == 0
        assert await client.models() == ["tiny"]
        assert await client.health()
    assert isinstance(completion, Completion)
    assert len(completion.token_ids) == len(completion.logprobs) == 8
    assert completion.finish_reason == "length"
    assert completion.policy_version == 0
    expected = rescore(engine.model, prompt, completion.token_ids)
    assert max(abs(a - b) for a, b in zip(completion.logprobs, expected, strict=True)) < 1e-4
    assert len(samples) == 3 and all(len(s.token_ids) == 5 for s in samples)
    assert completion.text == engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.model == "tiny" and completion.cached_tokens is not None and samples[0].cached_tokens is None


async def test_response_has_vllms_shape_and_our_version_extension(live_server: Any) -> None:
    payload = {
        "model": "tiny",
        "prompt": [1, 2, 3, 4],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 2,
        "return_token_ids": True,
        "stop_token_ids": None,
        "stop": None,
        "seed": None,
    }
    status, body, headers = await post(f"{live_server.url}/v1/completions", payload)
    assert status == 200
    assert set(body) == {"id", "object", "created", "model", "choices", "usage", "policy_version"}
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert headers["X-Policy-Version"] == "0" and body["policy_version"] == 0
    [choice] = body["choices"]
    assert set(choice) >= {"index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason"}
    assert choice["prompt_token_ids"] == [1, 2, 3, 4]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == len(choice["logprobs"]["tokens"])
    assert all(len(top) >= 1 for top in choice["logprobs"]["top_logprobs"])
    assert body["usage"] == {
            "prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}
        }  # fmt: skip

    payload.update(logprobs=0, return_tokens_as_token_ids=True)
    _, body, _ = await post(f"{live_server.url}/v1/completions", payload)
    [choice] = body["choices"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]

    status, body, _ = await post(f"{live_server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert status == 200 and body["choices"][0]["token_ids"] is None and body["choices"][0]["logprobs"] is None


async def test_text_and_multiple_prompts(live_server: Any) -> None:
    status, body, _ = await post(
        f"{live_server.url}/v1/completions",
        {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 3, "temperature": 0, "return_token_ids": True},
    )
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert body["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]  # greedy
    assert body["usage"]["prompt_tokens"] == 5
    status, body, _ = await post(f"{live_server.url}/v1/completions", {"prompt": "Hello there", "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 1


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"prompt": [], "max_tokens": 4}, "empty"),
        ({"prompt": "", "max_tokens": 4}, "empty"),
        ({"prompt": [1, 2], "max_tokens": 9000}, "context"),
        ({"prompt": [1, 2], "n": 0}, "n must be"),
        ({"prompt": [1, 2], "n": 99}, "n must be"),
        ({"prompt": [1, 2], "model": "gpt-4"}, "not served here"),
        ({"prompt": [1, 2], "max_tokens": "many"}, "max_tokens"),
        ({"prompt": [1, 2], "stream": True}, "stream"),
        ({"prompt": [1, 2], "presence_penalty": 0.5}, "presence_penalty"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": [1, 2], "logprobs": 50}, "logprobs"),
    ],
)
async def test_invalid_input_is_a_400_with_a_message(live_server: Any, payload: dict[str, Any], message: str) -> None:
    status, body, _ = await post(f"{live_server.url}/v1/completions", payload)
    assert status == 400
    assert message in body["error"]["message"]
    assert body["error"]["code"] == 400


async def test_client_raises_a_clear_inference_error(live_server: Any) -> None:
    async with CompletionClient(live_server.url, model="tiny") as client:
        with pytest.raises(InferenceError, match="context") as caught:
            await client.complete([1, 2, 3], max_tokens=100_000)
    assert caught.value.status == 400 and not caught.value.transient
    async with CompletionClient("http://127.0.0.1:9", model="tiny", timeout=5) as client:
        with pytest.raises(InferenceError) as unreachable:
            await client.complete([1, 2, 3], max_tokens=2)
    assert unreachable.value.status is None and unreachable.value.transient


async def test_concurrent_http_requests_are_batched(live_server: Any) -> None:
    metrics_before = await get_text(f"{live_server.url}/metrics")
    prefills_before = metric(metrics_before, "agentgym_inference_forward_batches_total", 'phase="prefill"')
    ok_before = metric(metrics_before, "agentgym_inference_requests_total", 'status="ok"')
    async with CompletionClient(live_server.url) as client:
        results = await asyncio.gather(
            *(client.complete([1, 2, 3 + i], max_tokens=8, temperature=1.0, seed=i) for i in range(12))
        )
    assert all(len(c.token_ids) == 8 for [c] in results)
    text = await get_text(f"{live_server.url}/metrics")
    prefills = metric(text, "agentgym_inference_forward_batches_total", 'phase="prefill"') - prefills_before
    assert metric(text, "agentgym_inference_requests_total", 'status="ok"') - ok_before == 12
    assert 1 <= prefills < 12
    for name in (
        "agentgym_inference_generated_tokens_total",
        "agentgym_inference_queue_wait_seconds_count",
        "agentgym_inference_generation_seconds_count",
        "agentgym_inference_batch_size_count",
    ):
        assert name in text


async def test_models_health_and_policy_version_routes(live_server: Any) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{live_server.url}/v1/models") as response:
            body = await response.json()
        [entry] = body["data"]
        assert entry["id"] == "tiny" and entry["policy_version"] == 0 and entry["max_model_len"] == 8192
        async with session.get(f"{live_server.url}/health") as response:
            assert response.status == 200 and (await response.json())["status"] == "ok"
        async with session.get(f"{live_server.url}/v1/policy_version") as response:
            assert (await response.json()) == {"policy_version": 0}


async def test_weight_reload_over_http(
    fresh_engine: Engine, other_tiny_dir: Path, tmp_path: Path, live_server_factory: Any
) -> None:
    with live_server_factory(fresh_engine) as server:
        async with CompletionClient(server.url) as client:
            [before] = await client.complete([7, 8, 9], max_tokens=6, temperature=0.0)
            with pytest.raises(InferenceError, match="still serving policy version 0") as bad:
                await client.load_weights(str(tmp_path / "nowhere"), 1)
            assert bad.value.status == 400
            [same] = await client.complete([7, 8, 9], max_tokens=6, temperature=0.0)
            assert same.token_ids == before.token_ids and same.policy_version == 0

            assert await client.load_weights(f"file://{other_tiny_dir}", 2) == 2
            [after] = await client.complete([7, 8, 9], max_tokens=6, temperature=0.0)
            assert after.policy_version == 2 and await client.policy_version() == 2
            assert after.token_ids != before.token_ids

            with pytest.raises(InferenceError) as stale:
                await client.load_weights(str(other_tiny_dir), 1)
            assert stale.value.status == 409
            status, body, _ = await post(f"{server.url}/v1/load_weights", {"uri": "x"})
            assert status == 400 and "version" in body["error"]["message"]


async def post_raw(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession() as session, session.post(url, data=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        (b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
        (b'{"prompt": [1, 2], "stop": "\\ud800", "max_tokens": 2}', "stop"),
        (b'{"prompt": [1, 2], "model": "\\ud800"}', "model"),
        (b'{"prompt": [1, 2], "\\ud800": 1}', None),  # an unknown key is ignored, whatever it holds
    ],
)
async def test_a_lone_surrogate_is_a_400_naming_the_field(live_server: Any, body: bytes, field: str | None) -> None:
    status, reply = await post_raw(f"{live_server.url}/v1/completions", body)
    if field is None:
        assert status == 200
        return
    assert status == 400 and reply["error"]["message"].startswith(f"{field}: not valid Unicode"), reply


async def test_huge_prompts_are_refused_before_tokenizing(live_server: Any) -> None:
    url = f"{live_server.url}/v1/completions"
    started = time.perf_counter()
    # 10 MB: past the request body cap, refused before it is read.
    status, reply = await post_raw(url, json.dumps({"prompt": "ab " * 3_500_000, "max_tokens": 1}).encode())
    assert status == 413 and reply["error"]["code"] == 413 and "too large" in reply["error"]["message"]
    # Under the body cap, but more characters than can fit the context: refused without tokenizing.
    status, reply = await post_raw(url, json.dumps({"prompt": "ab " * 200_000, "max_tokens": 1}).encode())
    assert status == 400 and "send token ids instead" in reply["error"]["message"]
    # A million token ids: refused fast too (by the body cap or by the context check).
    status, reply = await post_raw(url, json.dumps({"prompt": [1] * 1_000_000, "max_tokens": 1}).encode())
    assert status in (400, 413)
    assert time.perf_counter() - started < 5
    # A long prompt that fits still works.
    status, reply = await post_raw(url, json.dumps({"prompt": "go to the red door " * 300, "max_tokens": 1}).encode())
    assert status == 200, reply


async def test_openapi_says_what_the_routes_answer(live_server: Any) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{live_server.url}/openapi.json") as response:
        spec = await response.json()
    paths = spec["paths"]
    assert set(paths["/v1/completions"]["post"]["responses"]) == {"200", "400", "413", "503"}
    assert set(paths["/v1/load_weights"]["post"]["responses"]) == {"200", "400", "409", "413"}
    assert all("422" not in op["responses"] for ops in paths.values() for op in ops.values())
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    # And validation errors are the declared 400, in the declared shape.
    status, body, _ = await post(f"{live_server.url}/v1/completions", {"prompt": [1], "max_tokens": "x"})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
