"""The inference engine at GPU scale, prepared for a lent GPU: a rollout-shaped workload at batch 64 on a 0.5B shape.

Workload (the quickstart's rollout step, scaled up): `--conversations` (64) multi-turn conversations in flight at
once, `--turns` (5) turns each. Every turn sends the whole conversation so far (a `--prompt-tokens` prompt, earlier
replies and observations) plus a new `--observation-tokens` observation, and samples `--max-tokens` tokens at
temperature 1 with EOS ignored, so every run does the same work; a conversation's next turn goes out as soon as
its reply is back (continuous batching's case, and the prefix cache's). Printed per repeat and as medians:
generated tokens/s over the workload, turn latency p50 / p99, the prefix cache's share of prompt tokens; and one
stream alone (a 256-token prompt, greedy): decode tokens/s (64 new tokens vs 1) and the prefill's seconds.

Engines:
  (default)     the platform's engine (`agentgym.inference.engine.Engine`) in this process: bf16 on CUDA, float32
                on CPU;
  --server URL  any server of the platform's completions API serving the same folder (vLLM, the production engine
                on GPUs: `vllm serve DIR --dtype bfloat16`), through the platform's `CompletionClient`. EOS is not
                ignored there (the client has no such field; a random model samples it about once in 49k tokens).
vLLM is not on the lent GPU machines' image, and its CUDA wheel (~400 MB) cannot travel there (64 MiB a call, no
network), so there this measures the platform's engine; `--server` measures vLLM where it is installed.

Shapes (random weights from a config; SmolLM2's tokenizer, so the vocabulary is its 49,152 tokens, not Qwen's):
  0.5b   Qwen2.5-0.5B's layers: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4,864 (~0.4B parameters here)
  smoke  2 layers of width 64 on CPU: the test twin (tests/inference/test_inference_gpu_bench_smoke.py)

Usage: python benchmarks/inference_gpu_bench.py [--shape 0.5b] [--conversations 64] [--repeats 3] [--tokenizer DIR]
       python benchmarks/inference_gpu_bench.py --server http://127.0.0.1:8000 --model-dir DIR  (the folder it serves)
       python benchmarks/inference_gpu_bench.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import torch
from trainer_gpu_bench import SHAPES as TRAINER_SHAPES  # a sibling script (benchmarks/ is on sys.path)

from agentgym.inference.client import CompletionClient
from agentgym.inference.engine import Engine
from agentgym.inference.models import load_tokenizer, smollm2_tokenizer_dir
from agentgym.inference.sampling import SamplingParams

SHAPES: dict[str, dict[str, Any]] = {name: TRAINER_SHAPES[name] for name in ("0.5b", "smoke")}
"""The trainer's GPU benchmark's shapes; the vocabulary is replaced by the tokenizer's (`build_model`)."""

Generate = Callable[[list[int], int, int], Awaitable[list[int]]]
"""(prompt ids, max new tokens, seed) -> the sampled ids."""


def build_model(shape: str, tokenizer_dir: Path, out: Path, dtype: torch.dtype) -> Path:
    """A random-weight Qwen2-shaped model of `shape` with the tokenizer of `tokenizer_dir`, saved to `out`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = load_tokenizer(tokenizer_dir)
    config = Qwen2Config(
        **{**SHAPES[shape], "vocab_size": len(tokenizer), "tie_word_embeddings": True},
        max_position_embeddings=4096,
        use_sliding_window=False,
        sliding_window=None,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    for file in tokenizer_dir.iterdir():
        if file.is_file() and not file.name.startswith("config"):
            shutil.copy(file, out / file.name)
    return out


async def conversation(generate: Generate, index: int, vocab: int, args: argparse.Namespace) -> tuple[int, list[float]]:
    """One conversation's turns; returns (tokens sampled, each turn's latency)."""
    rng = random.Random(index)
    ids = [rng.randrange(5, vocab) for _ in range(args.prompt_tokens)]
    sampled, latencies = 0, []
    for turn in range(args.turns):
        ids += [rng.randrange(5, vocab) for _ in range(args.observation_tokens)]
        started = time.perf_counter()
        reply = await generate(ids, args.max_tokens, 1000 * index + turn)
        latencies.append(time.perf_counter() - started)
        ids += reply
        sampled += len(reply)
    return sampled, latencies


async def workload(generate: Generate, vocab: int, args: argparse.Namespace, offset: int) -> tuple[float, list[float]]:
    """(generated tokens/s, turn latencies) of all conversations at once; `offset` makes every repeat's ids new."""
    started = time.perf_counter()
    results = await asyncio.gather(
        *(conversation(generate, offset + index, vocab, args) for index in range(args.conversations))
    )
    wall = time.perf_counter() - started
    return sum(tokens for tokens, _ in results) / wall, [latency for _, turns in results for latency in turns]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_stream(generate_greedy: Generate, vocab: int, repeats: int = 3) -> tuple[float, float]:
    """(decode tokens/s, prefill seconds) of one request with a 256-token prompt: 64 new tokens vs 1, medians."""
    decode, prefill = [], []
    for repeat in range(repeats):
        prompts = [[(7 * i + 13 * (2 * repeat + k) + 11) % (vocab - 10) + 5 for i in range(256)] for k in (0, 1)]
        started = time.perf_counter()
        await generate_greedy(prompts[0], 1, 0)
        first = time.perf_counter() - started
        started = time.perf_counter()
        await generate_greedy(prompts[1], 64, 0)
        whole = time.perf_counter() - started
        prefill.append(first)
        decode.append(63 / max(whole - first, 1e-9))
    return statistics.median(decode), statistics.median(prefill)


async def measure(args: argparse.Namespace, folder: Path, device: str, dtype: str) -> None:
    vocab = len(load_tokenizer(folder))
    async with AsyncExitStack() as stack:
        engine: Engine | None = None
        if args.server:
            client = await stack.enter_async_context(CompletionClient(args.server, engine="vllm"))

            async def generate(ids: list[int], tokens: int, seed: int) -> list[int]:
                return (await client.complete(ids, tokens, temperature=1.0, seed=seed))[0].token_ids

            async def greedy(ids: list[int], tokens: int, seed: int) -> list[int]:
                return (await client.complete(ids, tokens, temperature=0.0))[0].token_ids

            name = f"server {args.server}"
        else:
            engine = Engine(folder, device=device, dtype=dtype, max_batch_size=args.conversations)
            stack.callback(engine.close)
            running = engine

            async def generate(ids: list[int], tokens: int, seed: int) -> list[int]:
                params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, ignore_eos=True)
                return (await running.generate(ids, params)).samples[0].token_ids

            async def greedy(ids: list[int], tokens: int, seed: int) -> list[int]:
                params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
                return (await running.generate(ids, params)).samples[0].token_ids

            name = f"platform engine ({dtype} on {device})"
        await generate([5, 6, 7, 8], 4, 0)  # warm-up: kernels chosen, memory pools filled
        decode, prefill = await one_stream(greedy, vocab)
        print(f"{name}: one stream {decode:.1f} decode tokens/s, 256-token prefill {prefill:.3f} s", flush=True)
        rates, latencies = [], []
        for repeat in range(args.repeats):
            hits_before = (engine.stats.prefix_hit_tokens, engine.stats.prompt_tokens) if engine else (0, 0)
            rate, turns = await workload(generate, vocab, args, offset=repeat * args.conversations)
            rates.append(rate)
            latencies += turns
            line = f"  [{repeat + 1}/{args.repeats}] {rate:9.1f} generated tokens/s"
            line += f", turn p50 {percentile(turns, 0.5):.3f} s"
            if engine is not None:
                hit = engine.stats.prefix_hit_tokens - hits_before[0]
                prompt = engine.stats.prompt_tokens - hits_before[1]
                line += f", prefix cache {hit / max(prompt, 1):.0%} of prompt tokens"
            print(line, flush=True)
        served = f"model {args.model_dir}" if args.model_dir else f"shape {args.shape}"
        print(
            f"## {name}, {served}, {args.conversations} conversations x {args.turns} turns x"
            f" {args.max_tokens} tokens: {statistics.median(rates):.1f} generated tokens/s (median of {args.repeats}),"
            f" turn p50 {percentile(latencies, 0.5):.3f} s, p99 {percentile(latencies, 0.99):.3f} s;"
            f" one stream {decode:.1f} tokens/s",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--smoke", action="store_true", help="the smoke shape on CPU, a small workload")
    parser.add_argument("--conversations", type=int, default=64, help="in flight at once (the batch)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--observation-tokens", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer folder (default: SmolLM2's, built here)")
    parser.add_argument("--server", help="measure this completions server instead of the in-process engine")
    parser.add_argument(
        "--model-dir", type=Path, help="a model folder instead of a built shape (--server: the served one)"
    )
    args = parser.parse_args(argv)
    if min(args.conversations, args.turns, args.prompt_tokens, args.max_tokens, args.repeats) < 1:
        parser.error("--conversations, --turns, --prompt-tokens, --max-tokens and --repeats must be >= 1")
    if args.observation_tokens < 0:
        parser.error("--observation-tokens must be >= 0")
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"--tokenizer: no tokenizer.json in {args.tokenizer}")
    if args.server and args.model_dir is None:
        parser.error("--server needs --model-dir, the folder it serves (its tokenizer gives the vocabulary)")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir: no config.json in {args.model_dir}")
    if args.smoke:
        args.shape = "smoke"
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    gpu = torch.cuda.get_device_name(0) if cuda else "none"
    print(f"# inference GPU bench: torch {torch.__version__}, GPU {gpu}, shape {args.shape}", flush=True)
    with tempfile.TemporaryDirectory(prefix="agentgym-inference-gpu-bench-") as scratch:
        folder = args.model_dir
        if folder is None:
            tokenizer = args.tokenizer or smollm2_tokenizer_dir()
            folder = build_model(args.shape, tokenizer, Path(scratch), torch.bfloat16 if cuda else torch.float32)
        asyncio.run(measure(args, folder, device, dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
