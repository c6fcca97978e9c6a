"""Inference benchmark: dynamic batching vs one request at a time, on the same server in the same run.

Starts `agentgym inference serve --model builtin:tiny` as a separate process on loopback, then measures
generated tokens per second for
  1. one request at a time (each waits for the previous one), and
  2. many concurrent requests through the HTTP server (batched by the engine),
and prints both, their ratio (target >= 4x), and the forward-pass counts read from /metrics.

Usage: python benchmarks/inference_bench.py [--model builtin:tiny] [--concurrency 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp

from agentgym.inference.client import CompletionClient
from agentgym.messaging import free_port


@contextmanager
def server(model: str, threads: int, max_batch_size: int) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "agentgym.cli", "inference", "serve", "--model", model, "--port", str(port)]
    cmd += ["--threads", str(threads), "--max-batch-size", str(max_batch_size), "--log-level", "warning"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()


async def wait_healthy(client: CompletionClient, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not await client.health():
        if time.monotonic() > deadline:
            raise SystemExit("the inference server did not become healthy")
        await asyncio.sleep(0.25)


async def forward_counts(url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()

    def value(phase: str) -> float:
        match = re.search(rf'agentgym_inference_forward_batches_total\{{phase="{phase}"\}} ([0-9.e+]+)', text)
        return float(match.group(1)) if match else 0.0

    return value("prefill"), value("decode")


def prompt(i: int, length: int) -> list[int]:
    """A deterministic prompt of `length` ids (distinct per request)."""
    return [(1000 + 37 * i + 11 * k) % 49000 + 100 for k in range(length)]


async def run(url: str, requests: int, concurrency: int, max_tokens: int, prompt_len: int, seed0: int) -> float:
    """Tokens per second for `requests` requests with at most `concurrency` in flight."""
    limit = asyncio.Semaphore(concurrency)
    async with CompletionClient(url, timeout=3600) as client:

        async def one(i: int) -> int:
            async with limit:
                [completion] = await client.complete(
                    prompt(seed0 + i, prompt_len), max_tokens=max_tokens, temperature=1.0, seed=seed0 + i
                )
                if len(completion.token_ids) != max_tokens:  # ignore_eos is not sent: EOS would end early
                    return len(completion.token_ids)
                return max_tokens

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
        return tokens / (time.perf_counter() - started)


async def main(args: argparse.Namespace) -> None:
    with server(args.model, args.threads, args.concurrency) as url:
        async with CompletionClient(url) as client:
            await wait_healthy(client)
            await client.complete(prompt(0, args.prompt_len), max_tokens=4)  # warm-up
        p0, d0 = await forward_counts(url)
        sequential = await run(url, args.sequential_requests, 1, args.max_tokens, args.prompt_len, 1000)
        p1, d1 = await forward_counts(url)
        batched = await run(url, args.requests, args.concurrency, args.max_tokens, args.prompt_len, 2000)
        p2, d2 = await forward_counts(url)
    print(f"model {args.model}, prompt {args.prompt_len} tokens, {args.max_tokens} tokens per request")
    print(
        f"one at a time : {sequential:8.1f} tokens/s  ({args.sequential_requests} requests, "
        f"{p1 - p0:.0f} prefill + {d1 - d0:.0f} decode forward passes)"
    )
    print(
        f"concurrent {args.concurrency:<3}: {batched:8.1f} tokens/s  ({args.requests} requests, "
        f"{p2 - p1:.0f} prefill + {d2 - d1:.0f} decode forward passes)"
    )
    ratio = batched / sequential
    print(f"speed-up      : {ratio:8.2f}x  (target >= 4x: {'met' if ratio >= 4 else 'NOT met'})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (and max batch size)")
    parser.add_argument("--requests", type=int, default=64, help="requests in the concurrent run")
    parser.add_argument("--sequential-requests", type=int, default=8, help="requests in the one-at-a-time run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    asyncio.run(main(parser.parse_args()))
