"""One rank of test_data_parallel: the trainer data-parallel over two ranks on DeepSpeed's CPU accelerator.

Run as ``python data_parallel_run.py <algorithm> <zero stage> <work dir> <tiny model dir>`` with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as the DeepSpeed
launcher sets them. Rank 0 leads the way the training loop does (announcing each trainer call), the
other rank follows. Trained: an SFT warm-up of two steps (the KL reference is then adopted from the
warmed-up policy), two RL steps with a checkpoint after the first, then fresh trainers on both ranks
resume from that checkpoint and redo the second step. Rank 0 also trains the same steps alone with
the plain torch backend and prints one JSON line comparing them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any, Literal

import torch

torch.set_num_threads(1)

from trainer_helpers import synthetic_trajectory, update_gap  # noqa: E402

from agentgym.proto import rl_pb2  # noqa: E402
from agentgym.trainer.config import RLTrainerConfig  # noqa: E402
from agentgym.trainer.distributed import DataParallel, follow, init_data_parallel  # noqa: E402
from agentgym.trainer.loop import _on_all_ranks  # noqa: E402
from agentgym.trainer.trainer import RLTrainer, SFTExample  # noqa: E402

GROUPS, GROUP_SIZE = 2, 3


def batch(step: int, policy_version: int) -> list[rl_pb2.Trajectory]:
    """Mixed outcomes in every group (a non-zero advantage); sampled log-probs stay the synthetic -2."""
    rng = random.Random(f"11/{step}")
    trajectories = [
        synthetic_trajectory(rng, step=step, group=g, sample=s, policy_version=policy_version)
        for g in range(GROUPS)
        for s in range(GROUP_SIZE)
    ]
    for k, t in enumerate(trajectories):
        t.success, t.final_score = k % 2 == 0, float(k % 2 == 0)
    return trajectories


def demonstrations() -> list[SFTExample]:
    return RLTrainer.rejection_sampling_examples(batch(99, 0), require_success=False)


def weights(trainer: RLTrainer) -> dict[str, torch.Tensor]:
    """The full weights (gathered from their partitions under ZeRO-3: every rank must call this)."""
    import deepspeed

    module = trainer.policy
    zero3 = getattr(trainer.engine, "zero_stage", 0) == 3
    with deepspeed.zero.GatheredParameters(list(module.parameters())) if zero3 else contextlib.nullcontext():
        return {name: p.detach().clone() for name, p in module.named_parameters()}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].float().numpy().tobytes())
    return h.hexdigest()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def lead_or_follow(trainer: RLTrainer, dp: DataParallel, script: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
    """Rank 0 makes the calls of ``script`` on every rank (as the training loop does); the others follow."""
    if not dp.is_main:
        follow(trainer)
        return []
    try:
        return [_on_all_ranks(trainer, method, *args) for method, args in script]
    finally:
        dp.stop_followers()


def main(algorithm: str, stage: int, work: Path, model: str) -> dict[str, Any] | None:
    dp = init_data_parallel()

    def config(name: str, backend: Literal["torch", "deepspeed"]) -> RLTrainerConfig:
        return RLTrainerConfig(
            model=model,
            output_dir=work / name,
            run="dp",
            algorithm=algorithm,  # type: ignore[arg-type]
            group_size=GROUP_SIZE,
            mini_batch_size=GROUPS * GROUP_SIZE,
            micro_batch_tokens=64,  # several packed rows per mini-batch, to split over the ranks
            learning_rate=1e-3,
            sft_learning_rate=1e-3,
            sft_batch_size=4,
            kl_coef=0.05 if algorithm != "ppo" else 0.0,
            recompute_old_logprobs=algorithm != "ppo",
            total_steps=10,
            tensorboard=False,
            otel_metrics=False,
            curriculum={"kind": "fixed", "max_turns": 5},
            backend=backend,
            zero_stage=stage,
            gpus=dp.world_size if backend == "deepspeed" else 0,
            bf16=False,
        )

    script: list[tuple[str, tuple[Any, ...]]] = [
        ("sft", (demonstrations(), 2)),
        ("train_step", (batch(0, 1),)),
        ("save_checkpoint", ()),
        ("train_step", (batch(1, 2),)),
    ]
    straight = RLTrainer(config("dp", "deepspeed"), data_parallel=dp)
    rows = [len(straight.models.pack(straight._batch(batch(s, 0)), list(range(GROUPS * GROUP_SIZE)))) for s in (0, 1)]
    results = lead_or_follow(straight, dp, script)
    straight_weights = weights(straight)
    agree = len(set(dp.gather(digest(straight_weights)))) == 1

    resumed = RLTrainer(config("dp", "deepspeed"), data_parallel=dp)
    resumed_results = lead_or_follow(resumed, dp, [("maybe_resume", ()), ("train_step", (batch(1, 2),))])
    resumed_weights = weights(resumed)
    if not dp.is_main:
        return None

    plain = RLTrainer(config("plain", "torch"))
    start = weights(plain)
    plain_sft = plain.sft(*script[0][1])
    plain_metrics = [plain.train_step(batch(0, 1)), plain.train_step(batch(1, 2))]
    dp_metrics = [results[1], results[3]]
    keys = ["policy_loss", "entropy", "kl", "clip_frac", "grad_norm", "tokens", "logprob_diff_max", "value_loss"]
    saved = Path(results[2])
    return {
        "rows": rows,
        "moved": max_diff(start, weights(plain)),
        "dp_vs_torch": update_gap(start, weights(plain), straight_weights),
        "resumed_vs_straight": max_diff(straight_weights, resumed_weights),
        "ranks_agree": agree,
        "resumed_from": str(resumed_results[0]),
        "saved": str(saved),
        "policy_version": [resumed.policy_version, plain.policy_version],
        "metrics": [
            {k: [m.train[k], p.train[k]] for k in keys if k in p.train}
            for m, p in zip(dp_metrics, plain_metrics, strict=True)
        ],
        "sft": [
            {k: [m[k], p[k]] for k in ("sft_loss", "grad_norm", "tokens")}
            for m, p in zip(results[0], plain_sft, strict=True)
        ],
        "counts": [m.counts["used"] for m in dp_metrics],
        "checkpoint_files": sorted(p.name for p in saved.iterdir()),
        "engine_files": sorted(str(p.relative_to(saved / "engine")) for p in (saved / "engine").rglob("*.pt")),
    }


if __name__ == "__main__":
    outcome = main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    if outcome is not None:
        print(json.dumps(outcome))
