"""Inference benchmark: dynamic batching vs one request at a time, on the same server in the same run.

Starts `agentgym inference serve --model builtin:tiny` as a separate process on loopback, then measures
generated tokens per second for
  1. one request at a time (each waits for the previous one), and
  2. many concurrent requests through the HTTP server (batched by the engine),
and prints both, their ratio (target >= 4x), and the forward-pass counts read from /metrics.

Then the multi-turn case of rollouts (skip it with `--conversations 0`): each conversation's next request
sends its whole context so far (a `--context`-token first prompt, then every sampled id and
`--observation` new ids per turn), one conversation at a time vs all of them concurrently, with the
prefix cache's hit ratio (`--prefix-cache-tokens 0` turns the cache off to compare).

Usage: python benchmarks/inference_bench.py [--model builtin:tiny] [--concurrency 32] [--max-tokens 32]
       [--conversations 16 --turns 4 --context 1600 --observation 32] [--prefix-cache-tokens N]
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
def server(model: str, threads: int, max_batch_size: int, prefix_cache_tokens: int | None = None) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "agentgym.cli", "inference", "serve", "--model", model, "--port", str(port)]
    cmd += ["--threads", str(threads), "--max-batch-size", str(max_batch_size), "--log-level", "warning"]
    if prefix_cache_tokens is not None:
        cmd += ["--prefix-cache-tokens", str(prefix_cache_tokens)]
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


async def metric_values(url: str, *names: str) -> list[float]:
    """Sample values from /metrics (`name` may include labels, as written there); 0 when absent."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    values = []
    for name in names:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
        values.append(float(match.group(1)) if match else 0.0)
    return values


async def forward_counts(url: str) -> tuple[float, float]:
    prefill, decode = await metric_values(
        url,
        'agentgym_inference_forward_batches_total{phase="prefill"}',
        'agentgym_inference_forward_batches_total{phase="decode"}',
    )
    return prefill, decode


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


async def run_conversations(url: str, args: argparse.Namespace, concurrency: int, seed0: int) -> float:
    """Tokens per second for `args.conversations` multi-turn conversations, at most `concurrency` in flight."""
    limit = asyncio.Semaphore(concurrency)
    async with CompletionClient(url, timeout=3600) as client:

        async def conversation(i: int) -> int:
            context = prompt(seed0 + i, args.context)
            generated = 0
            async with limit:
                for turn in range(args.turns):
                    [completion] = await client.complete(
                        context, max_tokens=args.max_tokens, temperature=1.0, seed=seed0 + i
                    )
                    generated += len(completion.token_ids)
                    observation = prompt(seed0 + 1000 + i * args.turns + turn, args.observation)
                    context = context + completion.token_ids + observation
            return generated

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(conversation(i) for i in range(args.conversations))))
        return tokens / (time.perf_counter() - started)


async def multi_turn(url: str, args: argparse.Namespace) -> None:
    names = (
        "agentgym_inference_prompt_tokens_total",
        "agentgym_inference_prefix_cache_hit_tokens_total",
        "agentgym_inference_prefill_tokens_total",
    )
    before = await metric_values(url, *names)
    sequential = await run_conversations(url, args, 1, 5000)
    middle = await metric_values(url, *names)
    concurrent = await run_conversations(url, args, args.conversations, 7000)
    after = await metric_values(url, *names)
    print(
        f"multi-turn: {args.conversations} conversations x {args.turns} turns, first prompt {args.context} tokens, "
        f"+{args.observation} new ids per turn, {args.max_tokens} tokens per turn"
    )
    for label, rate, (start, end) in (
        ("one at a time ", sequential, (before, middle)),
        (f"concurrent {args.conversations:<3}", concurrent, (middle, after)),
    ):
        prompt_tokens, hit_tokens, prefilled = (b - a for a, b in zip(start, end, strict=True))
        ratio = hit_tokens / prompt_tokens if prompt_tokens else 0.0
        print(
            f"{label}: {rate:8.1f} tokens/s  (prompt tokens {prompt_tokens:.0f}, from the prefix cache "
            f"{ratio:.0%}, prefilled {prefilled:.0f})"
        )
    print(f"speed-up      : {concurrent / sequential:8.2f}x")


async def main(args: argparse.Namespace) -> None:
    with server(args.model, args.threads, args.concurrency, args.prefix_cache_tokens) as url:
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
        print(f"speed-up      : {ratio:8.2f}x  (target >= 4x: {'met' if ratio >= 4 else 'NOT met'})", flush=True)
        if args.conversations:
            await multi_turn(url, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (and max batch size)")
    parser.add_argument("--requests", type=int, default=64, help="requests in the concurrent run")
    parser.add_argument("--sequential-requests", type=int, default=8, help="requests in the one-at-a-time run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--conversations", type=int, default=16, help="multi-turn conversations (0: skip)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--context", type=int, default=1600, help="first prompt of a conversation, in tokens")
    parser.add_argument("--observation", type=int, default=32, help="new ids appended to the context per turn")
    parser.add_argument("--prefix-cache-tokens", type=int, default=None, help="server's prefix-cache budget")
    asyncio.run(main(parser.parse_args()))
