"""Is bf16 worth it on this CPU? A training forward/backward (float32 vs bf16 autocast) and, with ``--inference``,
the inference engine's batched prefill and decode (float32 vs bf16 matmuls, the bf16
matrices packed in oneDNN's layout and plain).

The trainer autocasts to bf16 on CPU (``bf16: true``), and the engine serving ``--dtype bfloat16`` runs its matmuls
in bf16, only where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX, `agentgym.cpus.cpu_has_bf16_units`);
elsewhere oneDNN emulates it and both run several times slower than in float32. This script prints what this CPU
has and the measured ratios, the figures behind that rule. The inference rounds alternate between the two engines
(both loaded at once); each round sends `--sequences` distinct prompts of `--prompt-tokens` random ids at once,
first for one new token (prefill), then for `--new-tokens` (prefill + decode). Then one layer's decode attention
over bf16-rounded inputs: torch's bf16 kernel, against float32 on the bf16 cache upcast at every step and on a float32
cache (the engine times bf16 against a float32 cache once per shape, keeps the faster: `decoder.attention_in_float32`).

Usage: python benchmarks/cpu_bf16_bench.py [--tokens 2048] [--repeats 3]
       python benchmarks/cpu_bf16_bench.py --inference --model builtin:smollm2-135m [--sequences 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from agentgym.cpus import cpu_has_bf16_units
from agentgym.inference.models import resolve_model


def forward_backward_seconds(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype | None) -> float:
    started = time.perf_counter()
    with torch.autocast(device_type="cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def engine_round_seconds(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Wall time of generating `new_tokens` for every prompt at once (greedy, no early end)."""
    from agentgym.inference.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        await asyncio.gather(*(engine.generate(prompt, params) for prompt in prompts))

    started = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - started


def inference(args: argparse.Namespace) -> None:
    """Median prefill and prefill+decode times of a float32 and two bfloat16 engines (packed, plain), interleaved."""
    from agentgym.inference import decoder
    from agentgym.inference.engine import Engine

    def start(dtype: str) -> Engine:  # no prefix cache: every round must prefill its prompts again
        return Engine.from_name(
            args.model, device="cpu", dtype=dtype, max_batch_size=args.sequences, prefix_cache_tokens=0
        )

    engines = {dtype: start(dtype) for dtype in ("float32", "bfloat16")}
    packs = decoder._onednn_bf16
    decoder._onednn_bf16 = lambda: False  # the bf16 engine before its matrices were packed (decoder._pack)
    try:
        engines["bf16-plain"] = start("bfloat16")
    finally:
        decoder._onednn_bf16 = packs
    print(f"# engine, {args.model}: {args.sequences} sequences of {args.prompt_tokens} prompt tokens at once")
    if engines["bfloat16"].matmul_dtype is None:
        print("bfloat16 computes in float32 on this CPU (no bf16 units): nothing to compare")
        return
    generator = torch.Generator().manual_seed(0)
    vocab = engines["float32"].vocab_size
    prompts = [
        torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(args.sequences)
    ]
    times: dict[tuple[str, int], list[float]] = {}
    for engine in engines.values():
        engine_round_seconds(engine, prompts[:2], 2)  # warm-up: oneDNN picks its kernels
    for _ in range(args.repeats):
        for new_tokens in (1, args.new_tokens):
            for dtype, engine in engines.items():
                times.setdefault((dtype, new_tokens), []).append(engine_round_seconds(engine, prompts, new_tokens))
    for engine in engines.values():
        engine.close()
    medians = {key: statistics.median(values) for key, values in times.items()}
    for dtype in engines:
        prefill = medians[(dtype, 1)]
        decode = (medians[(dtype, args.new_tokens)] - prefill) / (args.new_tokens - 1)
        print(
            f"{dtype:>10}: prefill {prefill:.2f} s ({args.sequences * args.prompt_tokens / prefill:.0f} tokens/s),"
            f" decode step {decode * 1000:.0f} ms ({args.sequences / decode:.0f} tokens/s), medians of {args.repeats}"
        )
    prefill_ratio = medians[("float32", 1)] / medians[("bfloat16", 1)]
    fp32_decode = medians[("float32", args.new_tokens)] - medians[("float32", 1)]
    bf16_decode = medians[("bfloat16", args.new_tokens)] - medians[("bfloat16", 1)]
    print(f"bf16 speed-up: prefill {prefill_ratio:.2f}x, decode {fp32_decode / bf16_decode:.2f}x")
    plain_decode = medians[("bf16-plain", args.new_tokens)] - medians[("bf16-plain", 1)]
    packed_prefill = medians[("bf16-plain", 1)] / medians[("bfloat16", 1)]
    print(f"packed bf16 matrices vs plain: prefill {packed_prefill:.2f}x, decode {plain_decode / bf16_decode:.2f}x")
    lean = engines["bfloat16"]._lean
    if lean is not None:
        decode_attention(lean.heads, lean.kv_heads, lean.head_dim, args.sequences, args.prompt_tokens, args.repeats)


def decode_attention(heads: int, kv_heads: int, head_dim: int, rows: int, columns: int, repeats: int) -> None:
    """A decode step's attention (one query a row) over bf16-rounded q/K/V, one layer: torch's bf16 kernel on a bf16
    cache, the float32 kernel on that cache upcast at every step, and on a float32 cache of the same values (what
    the engine does where `decoder.attention_in_float32`, timed once per shape, says float32 is faster)."""
    from agentgym.inference import decoder

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, 1, head_dim, generator=generator).bfloat16()
    keys, values = (torch.randn(rows, kv_heads, columns, head_dim, generator=generator).bfloat16() for _ in "kv")
    keys32, values32 = keys.float(), values.float()
    allowed = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
    ways = {
        "bf16": lambda: decoder.shared_attention(q, keys, values, allowed, head_dim**-0.5, None),
        "upcast": lambda: decoder.shared_attention(
            q.float(), keys.float(), values.float(), allowed, head_dim**-0.5, None
        ).bfloat16(),
        "float32": lambda: decoder.shared_attention(
            q.float(), keys32, values32, allowed, head_dim**-0.5, None
        ).bfloat16(),
    }
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, attend in ways.items():
            started = time.perf_counter()
            for _ in range(20):
                attend()
            seconds[way].append((time.perf_counter() - started) / 20)
    bf16, upcast, float32 = (statistics.median(seconds[way]) * 1000 for way in ways)
    print(
        f"decode attention, {rows} rows over {columns} keys, one layer: bf16 kernel {bf16:.2f} ms,"
        f" bf16 cache upcast to float32 {upcast:.2f} ms, float32 cache {float32:.2f} ms ({bf16 / float32:.2f}x);"
        " the engine here: "
        + ("float32" if decoder.attention_in_float32(heads, kv_heads, head_dim, torch.bfloat16) else "bf16")
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--tokens", type=int, default=2048, help="one packed row, as in the learning check")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inference", action="store_true", help="also time the inference engine")
    parser.add_argument("--sequences", type=int, default=16, help="concurrent sequences of an inference round")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if min(args.tokens, args.repeats, args.sequences, args.prompt_tokens) < 1 or args.new_tokens < 2:
        parser.error("--tokens, --repeats, --sequences and --prompt-tokens must be >= 1, --new-tokens >= 2")

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=torch.float32).train()
    ids = torch.randint(0, int(model.config.vocab_size), (1, args.tokens), generator=torch.Generator().manual_seed(0))
    print(f"# bf16 autocast vs float32, {args.model}, {args.tokens} tokens, {os.cpu_count()} CPUs")
    print(f"torch {torch.__version__}")
    avx512_bf16, amx = torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported()
    print(
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, AVX512-BF16 {avx512_bf16}, AMX {amx}"
        f" -> bf16 units: {cpu_has_bf16_units()}"
    )
    medians: dict[str, float] = {}
    for name, dtype in (("float32", None), ("bf16 autocast", torch.bfloat16)):
        forward_backward_seconds(model, ids, dtype)  # warm-up: oneDNN picks its kernels
        times = [forward_backward_seconds(model, ids, dtype) for _ in range(args.repeats)]
        medians[name] = statistics.median(times)
        print(f"{name:>14}: forward+backward {medians[name]:.2f} s median of {args.repeats}")
    ratio = medians["bf16 autocast"] / medians["float32"]
    print(f"bf16 / float32 time: {ratio:.2f}x ({'bf16 faster' if ratio < 1 else 'float32 faster'})")
    if args.inference:
        inference(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
