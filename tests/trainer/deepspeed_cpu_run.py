"""Child process of test_deepspeed_engine: the trainer on DeepSpeed's CPU accelerator, one rank.

Run as ``python deepspeed_cpu_run.py <zero stage> <work dir> <tiny model dir> [fp32|bf16]``. A process of its own
because DeepSpeed sets up ``torch.distributed`` (gloo) and its own globals, which must not leak into
the pytest process. Trains the same two GRPO steps three ways (plain torch; DeepSpeed straight;
DeepSpeed 1 step + checkpoint + a fresh engine resuming + 1 step) and prints one JSON line with how
far apart the weights end up, plus what the checkpoint holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, Literal

import torch

# One rank of a one-rank job: what the DeepSpeed launcher would export.
for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
    os.environ.setdefault(key, value)
torch.set_num_threads(1)

from trainer_helpers import fill_logprobs, synthetic_trajectory, update_gap  # noqa: E402

from agentgym.proto import rl_pb2  # noqa: E402
from agentgym.trainer.config import RLTrainerConfig  # noqa: E402
from agentgym.trainer.trainer import RLTrainer  # noqa: E402


def batch(trainer: RLTrainer, step: int) -> list[rl_pb2.Trajectory]:
    rng = random.Random(f"7/{step}")
    trajectories = [
        synthetic_trajectory(rng, step=step, group=g, sample=s, policy_version=trainer.policy_version)
        for g in range(2)
        for s in range(3)
    ]
    for k, t in enumerate(trajectories):  # mixed outcomes in each group: a non-zero GRPO advantage
        t.success, t.final_score = k % 2 == 0, float(k % 2 == 0)
    fill_logprobs(trainer.policy, trajectories)
    return trajectories


def weights(trainer: RLTrainer) -> dict[str, torch.Tensor]:
    """The full weights (gathered from their partitions under ZeRO-3)."""
    import deepspeed

    module = trainer.policy
    zero3 = getattr(trainer.engine, "zero_stage", 0) == 3
    with deepspeed.zero.GatheredParameters(list(module.parameters())) if zero3 else contextlib.nullcontext():
        return {name: p.detach().clone() for name, p in module.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main(stage: int, work: Path, model: str, precision: str = "fp32") -> dict[str, Any]:
    bf16 = precision == "bf16"  # DeepSpeed's bf16 (bf16 weights, fp32 master copy) and gradient checkpointing

    def config(name: str, backend: Literal["torch", "deepspeed"]) -> RLTrainerConfig:
        return RLTrainerConfig(
            model=model,
            output_dir=work / name,
            run="ds",
            algorithm="grpo",
            group_size=3,
            mini_batch_size=3,
            micro_batch_tokens=64,  # several packed rows per mini-batch: gradients accumulate over them
            learning_rate=1e-3,
            kl_coef=0.0,
            total_steps=10,
            tensorboard=False,
            otel_metrics=False,
            curriculum={"kind": "fixed", "max_turns": 5},
            backend=backend,
            zero_stage=stage,
            gpus=1,
            bf16=bf16 and backend == "deepspeed",
            gradient_checkpointing=bf16 and backend == "deepspeed",
        )

    torch.manual_seed(0)
    plain = RLTrainer(config("plain", "torch"))
    start = weights(plain)
    plain_grad_norms = [plain.train_step(batch(plain, step)).train["grad_norm"] for step in range(2)]

    torch.manual_seed(0)
    straight = RLTrainer(config("straight", "deepspeed"))
    engine = type(straight.engine).__name__
    dtype = str(next(straight.policy.parameters()).dtype)
    optimizer = type(getattr(straight.engine.optimizer, "optimizer", straight.engine.optimizer)).__name__
    start_diff = max_diff(start, weights(straight))
    grad_norms = []
    for step in range(2):
        grad_norms.append(straight.train_step(batch(straight, step)).train["grad_norm"])

    torch.manual_seed(0)
    first = RLTrainer(config("resumed", "deepspeed"))
    first.train_step(batch(first, 0))
    saved = first.save_checkpoint()
    del first
    torch.manual_seed(123)  # a restarted process starts from some other RNG state
    second = RLTrainer(config("resumed", "deepspeed"))
    resumed_from = second.maybe_resume()
    second.train_step(batch(second, 1))

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(saved, dtype="auto")  # as saved
    return {
        "engine": engine,
        "optimizer": optimizer,
        "start_diff": start_diff,
        "moved": max_diff(start, weights(straight)),
        "deepspeed_vs_torch": update_gap(start, weights(plain), weights(straight)),
        "resumed_vs_straight": max_diff(weights(straight), weights(second)),
        "grad_norms": grad_norms,
        "plain_grad_norms": plain_grad_norms,
        "dtype": dtype,
        "exported_dtype": str(next(exported.parameters()).dtype),
        "resumed_from": str(resumed_from),
        "saved": str(saved),
        "checkpoint_files": sorted(p.name for p in saved.iterdir()),
        "exported_parameters": sum(p.numel() for p in exported.parameters()),
        "expected_parameters": sum(p.numel() for p in plain.policy.parameters()),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], *sys.argv[4:5])))
