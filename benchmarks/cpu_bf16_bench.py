"""Is bf16 autocast worth it on this CPU? One training forward/backward of the tiny model, float32 vs bf16.

The trainer autocasts to bf16 on CPU (``bf16: true``) only where the CPU multiplies bf16 in hardware
(AVX512-BF16 or AMX, `agentgym.trainer.policy.cpu_has_bf16_units`); elsewhere oneDNN emulates it and
the update runs several times slower than in float32. This script prints what this CPU has and the
measured ratio, the figure behind that rule.

Usage: python benchmarks/cpu_bf16_bench.py [--tokens 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from agentgym.inference.models import resolve_model
from agentgym.trainer.policy import cpu_has_bf16_units


def forward_backward_seconds(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype | None) -> float:
    started = time.perf_counter()
    with torch.autocast(device_type="cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--tokens", type=int, default=2048, help="one packed row, as in the learning check")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
