"""Trainer step benchmark: tokens/s and MFU of RLTrainer.train_step vs a naive HF forward+backward.

Shapes: Qwen2.5-0.5B and Qwen2.5-1.5B (random weights, built from their configs), on one GPU.
Both methods train on the SAME synthetic multi-turn batch (prompt | action obs action obs ... ,
loss on the action tokens; lengths vary like agent episodes) with the same PPO-clip surrogate,
the same precision and one AdamW step per batch:

naive      padded micro-batches of ``--naive-micro-seqs`` sequences, ``model(input_ids, attention_mask)``
           (full ``[tokens, vocab]`` logits, cast to fp32), log-softmax, loss, backward.
trainer    ``RLTrainer.train_step``: sequence packing into rows of ``--micro-batch-tokens`` (no
           padding), flash-attention varlen via position ids when ``flash_attn`` is installed (else
           sdpa with a block-diagonal mask), the LM head only on the scored (sampled) tokens, in
           chunks, fused AdamW.

Printed per shape and method: real (non-padding) tokens/s, step time, peak memory, and MFU =
useful model FLOPs / (time * peak FLOPS). Useful FLOPs are counted the same way for both
methods: ``6 * N_non_embedding * tokens`` (dense layers) ``+ 6 * layers * hidden * sum(len_i^2)`` (causal
attention per sequence, forward+backward) ``+ 6 * vocab * hidden * sampled_tokens`` (the LM head where a
loss is needed).
Peak: bf16 dense of the detected GPU (H100/H200 989 TFLOPS, A100 312) or ``--peak-tflops``.
Targets (GPU): trainer >= 1.3x naive tokens/s at every shape, and MFU >= 50 % at 1.5B; exit 1 when
missed. A packed-vs-unpacked log-prob check runs first on the real attention kernel.

Usage:
    python benchmarks/trainer_gpu_bench.py                      # GPU: 0.5b and 1.5b, ~3-5 min on an H100/H200
    python benchmarks/trainer_gpu_bench.py --shapes 1.5b --sequences 96
    python benchmarks/trainer_gpu_bench.py --smoke              # CPU smoke test (tiny shape, no targets)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from agentgym.proto import rl_pb2
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.losses import policy_loss, token_logprobs
from agentgym.trainer.packing import forward_packed, pack_sequences, response_logprobs_unpacked
from agentgym.trainer.trainer import RLTrainer

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B / 1.5B (config.json of the HF releases)
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "smoke": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "tie_word_embeddings": True,
    },
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}
TARGET_SPEEDUP = 1.3
TARGET_MFU_1_5B = 0.50


@dataclass
class Profile:
    sequences: int
    prompt: tuple[int, int]
    turns: tuple[int, int]
    action: tuple[int, int]
    observation: tuple[int, int]


GPU_PROFILE = Profile(64, (300, 700), (3, 8), (40, 160), (60, 300))
SMOKE_PROFILE = Profile(8, (20, 40), (1, 3), (5, 15), (5, 20))


def synthetic_batch(profile: Profile, vocab: int, seed: int, group_size: int = 8) -> list[rl_pb2.Trajectory]:
    """Random-id trajectories shaped by ``profile``; trajectory ``i`` is in group ``i // group_size``."""
    rng = random.Random(seed)
    batch = []
    for i in range(profile.sequences):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(*profile.prompt))]
        response: list[int] = []
        mask: list[int] = []
        turns = rng.randint(*profile.turns)
        for k in range(turns):
            n = rng.randint(*profile.action)
            response += [rng.randrange(10, vocab) for _ in range(n)]
            mask += [1] * n
            if k < turns - 1:
                n = rng.randint(*profile.observation)
                response += [rng.randrange(10, vocab) for _ in range(n)]
                mask += [0] * n
        won = rng.random() < 0.5
        batch.append(
            rl_pb2.Trajectory(
                trajectory_id=f"t{i}",
                group_id=f"g{i // group_size}",
                sample_index=i % group_size,
                environment="textcraft",
                prompt_token_ids=prompt,
                response_token_ids=response,
                loss_mask=mask,
                sampled_logprobs=[-1.0 if m else 0.0 for m in mask],
                final_score=1.0 if won else 0.0,
                success=won,
                termination=rl_pb2.TERMINATION_DONE,
            )
        )
    return batch


def useful_flops(model_config: Any, batch: list[rl_pb2.Trajectory], non_embedding_params: int) -> float:
    hidden = model_config.hidden_size
    layers = model_config.num_hidden_layers
    lengths = [len(t.prompt_token_ids) + len(t.response_token_ids) for t in batch]
    sampled = sum(sum(t.loss_mask) for t in batch)
    dense = 6.0 * non_embedding_params * sum(lengths)
    attention = 6.0 * layers * hidden * sum(n * n for n in lengths)  # causal: half of 4*n^2*d fwd, x3 fwd+bwd
    head = 6.0 * model_config.vocab_size * hidden * sampled
    return dense + attention + head


def build_model(shape: str, device: torch.device, dtype: torch.dtype, attn: str, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, use_cache=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model: torch.nn.Module = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.train()


def non_embedding_params(model: torch.nn.Module) -> int:
    embed = model.get_input_embeddings().weight  # type: ignore[operator]
    total = sum(p.numel() for p in model.parameters())  # tied head counted once
    return total - embed.numel()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def naive_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: list[rl_pb2.Trajectory],
    micro_seqs: int,
    device: torch.device,
) -> None:
    """The textbook loop: pad, full logits in fp32, log-softmax, masked PPO loss, backward, one step."""
    total_tokens = sum(sum(t.loss_mask) for t in batch)
    advantages = [1.0 if t.success else -1.0 for t in batch]
    for start in range(0, len(batch), micro_seqs):
        chunk = batch[start : start + micro_seqs]
        seqs = [list(t.prompt_token_ids) + list(t.response_token_ids) for t in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width - 1)
        old = torch.zeros(len(chunk), width - 1)
        adv = torch.zeros(len(chunk), width - 1)
        for b, (t, s) in enumerate(zip(chunk, seqs, strict=True)):
            ids[b, : len(s)] = torch.tensor(s)
            attention[b, : len(s)] = 1
            p = len(t.prompt_token_ids)
            r = len(t.response_token_ids)
            mask[b, p - 1 : p - 1 + r] = torch.tensor(list(t.loss_mask), dtype=torch.float32)
            old[b, p - 1 : p - 1 + r] = torch.tensor(list(t.sampled_logprobs))
            adv[b, p - 1 : p - 1 + r] = advantages[start + b]
        ids, attention = ids.to(device), attention.to(device)
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
        logp = token_logprobs(logits[:, :-1], ids[:, 1:])
        m = mask.to(device)
        loss, _ = policy_loss(logp, old.to(device), adv.to(device), m, 0.2, 0.2)
        (loss * (float(m.sum()) / total_tokens)).backward()
        del logits, logp, loss
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fresh_ids(batch: list[rl_pb2.Trajectory], tag: str) -> list[rl_pb2.Trajectory]:
    out = []
    for t in batch:
        copy = rl_pb2.Trajectory()
        copy.CopyFrom(t)
        copy.trajectory_id = f"{t.trajectory_id}/{tag}"
        out.append(copy)
    return out


def packing_check(model: torch.nn.Module, batch: list[rl_pb2.Trajectory], micro_tokens: int) -> float:
    """Max |packed - unpacked| log-prob over two sequences, with the model's attention kernel."""
    seqs = [list(t.prompt_token_ids) + list(t.response_token_ids) for t in batch[:2]]
    starts = [len(t.prompt_token_ids) for t in batch[:2]]
    worst = 0.0
    with torch.no_grad():
        for row in pack_sequences(seqs, starts, max(micro_tokens, sum(len(s) for s in seqs))):
            out = forward_packed(model, row)
            for seg, lp in zip(row.segments, out.logprobs, strict=True):
                ref = response_logprobs_unpacked(model, seqs[seg.index], starts[seg.index])
                worst = max(worst, float((lp - ref).abs().max()))
    return worst


@dataclass
class Result:
    method: str
    seconds: float
    tokens: int
    flops: float
    peak_memory_gb: float

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def mfu(self, peak: float | None) -> float | None:
        return None if not peak else self.flops / self.seconds / peak


def measure(
    method: str,
    shape: str,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    batch: list[rl_pb2.Trajectory],
) -> tuple[Result, float | None]:
    attn = "sdpa" if method == "naive" else args.attn
    model = build_model(shape, device, dtype, attn, args.seed)
    flops_per_step = useful_flops(model.config, batch, non_embedding_params(model))
    tokens_per_step = sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in batch)
    check: float | None = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if method == "naive":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def step(k: int) -> None:
            naive_step(model, optimizer, batch, args.naive_micro_seqs, device)

    else:
        check = packing_check(model, batch, args.micro_batch_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            config = RLTrainerConfig(
                model="(in memory)",
                output_dir=tmp,
                device=str(device),
                dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                algorithm="grpo",
                group_size=8,
                mini_batch_size=len(batch),
                micro_batch_tokens=args.micro_batch_tokens,
                kl_coef=0.0,
                learning_rate=1e-6,
                gradient_checkpointing=args.gradient_checkpointing,
                tensorboard=False,
                otel_metrics=False,
            )
            trainer = RLTrainer(config, model=model, write_metrics=False)

        def step(k: int) -> None:
            trainer.train_step(fresh_ids(batch, str(k)))

    for k in range(args.warmup):
        step(-1 - k)
    sync(device)
    started = time.perf_counter()
    for k in range(args.steps):
        step(k)
    sync(device)
    elapsed = time.perf_counter() - started
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return Result(method, elapsed / args.steps, tokens_per_step, flops_per_step, peak_memory), check


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    print(f"unknown GPU {name!r}: pass --peak-tflops for MFU", file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU: a smoke test, no targets")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--sequences", type=int, default=None, help="trajectories per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="packed row size (default 16384 with flash attention, 4096 with sdpa: its dense mask spans the row)",
    )
    parser.add_argument("--naive-micro-seqs", type=int, default=4)
    parser.add_argument("--attn", default="auto", help="trainer attention: auto, flash_attention_2, sdpa, eager")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype, shapes, profile = torch.device("cpu"), torch.float32, ["smoke"], SMOKE_PROFILE
        args.steps, args.warmup = min(args.steps, 1), 0
        args.micro_batch_tokens = args.micro_batch_tokens or 512
    else:
        if not torch.cuda.is_available():
            print("no GPU: run with --smoke for the CPU smoke test", file=sys.stderr)
            return 2
        device, dtype, profile = torch.device("cuda"), torch.bfloat16, GPU_PROFILE
        shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if args.attn == "auto":
        has_flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        args.attn = "flash_attention_2" if has_flash else "sdpa"
    if args.micro_batch_tokens is None:
        args.micro_batch_tokens = 16384 if args.attn.startswith("flash") else 4096
    if args.sequences:
        profile = Profile(args.sequences, profile.prompt, profile.turns, profile.action, profile.observation)
    peak = peak_flops(device, args.peak_tflops)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test, NOT a GPU result)"
    print(f"device: {where}; trainer attention: {args.attn}; rows of {args.micro_batch_tokens} tokens; dtype: {dtype}")

    failures = []
    for shape in shapes:
        batch = synthetic_batch(profile, SHAPES[shape]["vocab_size"], args.seed)
        lengths = [len(t.prompt_token_ids) + len(t.response_token_ids) for t in batch]
        print(
            f"\n== {shape}: {len(batch)} trajectories, {sum(lengths)} tokens "
            f"(len {min(lengths)}-{max(lengths)}), {sum(sum(t.loss_mask) for t in batch)} sampled"
        )
        naive, _ = measure("naive", shape, args, device, dtype, batch)
        free_memory(device)  # the model and optimizer of one method are gone before the next is built
        ours, check = measure("trainer", shape, args, device, dtype, batch)
        free_memory(device)
        print(f"packed vs unpacked log-probs: max |diff| = {check:.2e}")
        print(f"{'method':<9} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'peak GB':>8}")
        for r in (naive, ours):
            mfu = r.mfu(peak)
            mfu_text = f"{100 * mfu:6.1f}%" if mfu is not None else "    n/a"
            print(f"{r.method:<9} {r.seconds:8.3f} {r.tokens_per_s():10.0f} {mfu_text} {r.peak_memory_gb:8.1f}")
        speedup = ours.tokens_per_s() / naive.tokens_per_s()
        print(f"speedup trainer / naive: {speedup:.2f}x (target >= {TARGET_SPEEDUP}x)")
        if not args.smoke:
            if speedup < TARGET_SPEEDUP:
                failures.append(f"{shape}: speedup {speedup:.2f}x < {TARGET_SPEEDUP}x")
            mfu = ours.mfu(peak)
            if shape == "1.5b" and mfu is not None and mfu < TARGET_MFU_1_5B:
                failures.append(f"1.5b: MFU {100 * mfu:.1f}% < {100 * TARGET_MFU_1_5B:.0f}%")
            if check is not None and not math.isfinite(check):
                failures.append(f"{shape}: packed forward gave non-finite log-probs")
    if args.smoke:
        print("\nsmoke test only: these figures are CPU numbers, not the GPU targets")
        return 0
    for failure in failures:
        print(f"TARGET MISSED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
