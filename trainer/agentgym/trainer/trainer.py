"""``RLTrainer``: one RL step from a list of Trajectories, checkpoints, SFT / rejection sampling / DPO.

Usable without NATS (the local runner drives it in-process)::

    trainer = RLTrainer(RLTrainerConfig(model="builtin:tiny", output_dir="runs/demo", group_size=4))
    trainer.maybe_resume()                          # latest checkpoint under runs/demo/checkpoints
    metrics = trainer.train_step(trajectories)      # -> StepMetrics; step += 1, policy_version += 1
    path = trainer.save_checkpoint()                # runs/demo/checkpoints/step-<n>/
    trainer.current_policy_dir                      # the HF folder inference should serve now

One step (:meth:`RLTrainer.train_step`)
---------------------------------------
1. Drop duplicates (trajectory ids seen before, in this batch or in earlier steps, including steps
   before a restart: the recent ids are checkpointed) and malformed trajectories (token, mask and
   logprob lengths disagree, no prompt). Both are counted.
2. Rollout statistics per environment over what remains (failed episodes included).
3. Failed trajectories (TERMINATION_ERROR) are excluded from the loss unless ``train_on_failed``;
   so are trajectories without a sampled token, and with ``drop_uniform_groups`` the groups whose
   samples all got the same outcome (counted as ``uniform_groups``).
4. Old log-probs: the engine's ``sampled_logprobs`` (default), or recomputed with the training
   model (``recompute_old_logprobs``). Either way the step reports ``logprob_diff_max`` /
   ``logprob_diff_mean``, the gap between the engine's and the trainer's log-probs of the sampled
   tokens under the same weights (recomputed over the whole batch, or measured on the first
   mini-batch before any update), which catches engine/trainer mismatch.
5. Advantages over the whole step: GRPO / RLOO from one score per trajectory grouped by
   ``group_id``; REINFORCE++ and PPO-GAE from token rewards (``agentgym.trainer.rewards``), PPO
   with the separate critic of ``agentgym.trainer.critic``.
6. ``epochs`` passes over shuffled mini-batches of ``mini_batch_size`` trajectories (whole groups
   together with ``mini_batches_by_group``, see :func:`mini_batch_order`); each
   mini-batch is packed into rows of ``micro_batch_tokens`` (``agentgym.trainer.packing``), one
   forward/backward per row, one optimiser step per mini-batch. Shuffling is seeded by
   ``(seed, step)``, so a resumed run makes the same updates.
7. The horizon schedule is updated with the step's ``success_rate`` and ``truncation_rate``.

Data-parallel (``data_parallel`` with several ranks, DeepSpeed): every rank makes the same calls on
the same trajectories; each forward/backward pass above takes only this rank's share of the packed
rows, and the step's metrics are summed over the ranks (``agentgym.trainer.distributed``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from agentgym.allocator import retain_freed_memory
from agentgym.proto import rl_pb2
from agentgym.trainer import advantages as adv
from agentgym.trainer.backend import OptimizerSettings, PolicyEngine, TorchEngine
from agentgym.trainer.checkpoint import (
    STATE_FILE,
    RecentIds,
    atomic_directory,
    capture_rng_state,
    latest_checkpoint,
    load_hf_weights,
    prune_checkpoints,
    restore_rng_state,
)
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.critic import ValueModel
from agentgym.trainer.distributed import DataParallel
from agentgym.trainer.losses import aggregate_loss, dpo_loss, kl_loss, kl_penalty, policy_loss, value_loss
from agentgym.trainer.metrics import MetricsSink, flatten_metrics, rollout_metrics
from agentgym.trainer.packed_attention import PACKED_ATTENTION, register_packed_attention
from agentgym.trainer.packing import PackedRow, SequenceOutputs, attention_kind, forward_packed, pack_sequences
from agentgym.trainer.rewards import (
    token_rewards,
    trajectory_scores,
    turn_states,
    turn_validity,
    uniform_outcome_groups,
)

log = logging.getLogger(__name__)

__all__ = ["DPOPair", "RLTrainer", "SFTExample", "StepMetrics", "cpu_has_bf16_units", "group_key", "mini_batch_order"]

CHECKPOINT_FORMAT = 1
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles).

    Without them oneDNN emulates bf16 matmuls: a tiny-model forward/backward measured 33x slower than in
    float32 on a 2-core AVX2 EPYC (``benchmarks/cpu_bf16_bench.py``); with them a learning-check update was
    1.06x faster than float32 on an AVX512-BF16 Xeon (``benchmarks/packed_attention_bench.py``).
    """
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@dataclass
class StepMetrics:
    """What one step did. ``env`` holds rollout stats per environment and ``all``; ``train`` the losses."""

    step: int
    policy_version: int
    horizon: int
    stage: int
    env: dict[str, dict[str, float]] = field(default_factory=dict)
    train: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        """The JSON-able record written to ``metrics.jsonl``."""
        return {
            "policy_version": self.policy_version,
            "horizon": self.horizon,
            "stage": self.stage,
            **self.train,
            **{f"count/{k}": v for k, v in self.counts.items()},
            "env": self.env,
        }

    def flat(self) -> dict[str, float]:
        return flatten_metrics(self.as_record())


@dataclass(frozen=True)
class SFTExample:
    """A supervised sequence in rollout layout: ``prompt_ids | response_ids``, loss where ``loss_mask`` is 1."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    environment: str = ""
    task_id: str = ""

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.loss_mask):
            raise ValueError("loss_mask must align with response_ids")
        if not self.prompt_ids:
            raise ValueError("an SFT example needs a prompt")


@dataclass(frozen=True)
class DPOPair:
    """Two trajectories of the same task: ``chosen`` scored higher than ``rejected``."""

    chosen: SFTExample
    rejected: SFTExample


@dataclass
class _Batch:
    trajectories: list[rl_pb2.Trajectory]
    sequences: list[list[int]]
    starts: list[int]
    mask: Tensor  # [B, T] float
    sampled_logprobs: Tensor  # [B, T]
    lengths: list[int]  # response lengths

    @property
    def size(self) -> int:
        return len(self.trajectories)


def _validate(trajectory: rl_pb2.Trajectory) -> str | None:
    n = len(trajectory.response_token_ids)
    if not trajectory.prompt_token_ids:
        return "no prompt tokens"
    if len(trajectory.loss_mask) != n:
        return f"loss_mask has {len(trajectory.loss_mask)} entries for {n} response tokens"
    if len(trajectory.sampled_logprobs) != n:
        return f"sampled_logprobs has {len(trajectory.sampled_logprobs)} entries for {n} response tokens"
    if any(m not in (0, 1) for m in trajectory.loss_mask):
        return "loss_mask must be 0/1"
    if any(not math.isfinite(lp) for lp in trajectory.sampled_logprobs):
        return "non-finite sampled logprob"
    return None


def _seed_for(*parts: object) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in the backward pass (transformers 5 name, or the older one)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
        return
    legacy = getattr(model, "gradient_checkpointing_enable", None)
    if legacy is None:
        raise TypeError(f"{type(model).__name__} does not support activation checkpointing")
    legacy(gradient_checkpointing_kwargs=kwargs)


def group_key(trajectory: rl_pb2.Trajectory) -> str:
    """The group a trajectory's advantage is computed in: its ``group_id``, else its step and task."""
    return trajectory.group_id or f"{trajectory.step}/{trajectory.task_id}"


def mini_batch_order(group_ids: Sequence[str], generator: torch.Generator, *, by_group: bool = True) -> list[int]:
    """A seeded random order of the batch indices; consecutive slices of it are the mini-batches.

    ``by_group``: the groups in random order, each group's indices together (in random order): a
    mini-batch of ``k * group_size`` holds ``k`` whole groups, and packing forwards each group's
    shared prompt once for all its samples in the mini-batch instead of once per group member it
    happens to draw. Otherwise a plain permutation.
    """
    order = torch.randperm(len(group_ids), generator=generator).tolist()
    if not by_group:
        return order
    groups: dict[str, list[int]] = {}
    for i in order:  # first appearance in the permutation orders the groups
        groups.setdefault(group_ids[i], []).append(i)
    return [i for members in groups.values() for i in members]


def _resolve_model_folder(name: str) -> Path:
    from agentgym.inference.models import resolve_model

    return Path(resolve_model(name))


class RLTrainer:
    """The policy, its optimiser (and reference / critic when needed), the schedule and the step counter."""

    def __init__(
        self,
        config: RLTrainerConfig,
        *,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        metrics_sink: MetricsSink | None = None,
        write_metrics: bool = True,
        data_parallel: DataParallel | None = None,
    ) -> None:
        self.config = config
        self.dp = data_parallel or DataParallel()
        if self.dp.enabled and config.backend != "deepspeed":
            raise ValueError(f"data-parallel training over {self.dp.world_size} ranks needs backend 'deepspeed'")
        self.device = self._pick_device()
        if self.device.type == "cpu":
            retain_freed_memory()  # the [tokens, vocab] logits and their gradients reuse freed buffers each step
        self.param_dtype = self._param_dtype()
        self.autocast_dtype = self._autocast_dtype()
        self.model_folder: Path | None = None
        if model is None:
            self.model_folder = _resolve_model_folder(config.model)
            model = self._load_lm(self.model_folder)
        self.policy = model.to(self.device)
        self.policy.train()
        if config.gradient_checkpointing:
            _enable_activation_checkpointing(self.policy)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.reference: nn.Module | None = None
        self.reference_dir: Path | None = None  # set once the SFT warm-up's policy is the reference
        if config.uses_reference:
            self.reference = self._frozen_copy(self.policy)
        self.critic: ValueModel | None = None
        self.critic_engine: TorchEngine | None = None
        if config.algorithm == "ppo":
            self.critic = self._build_critic()
            self.dp.broadcast_parameters(self.critic)  # every rank's critic starts from rank 0's
        self.engine: PolicyEngine = self._build_engine()
        if self.critic is not None:
            self.critic_engine = TorchEngine(
                self.critic,
                OptimizerSettings(
                    config.critic_learning_rate,
                    config.adam_betas,
                    config.adam_eps,
                    config.weight_decay,
                    config.max_grad_norm,
                ),
            )
        self.schedule = config.build_schedule()
        self.seen_ids = RecentIds(config.recent_ids_capacity)
        self.step = 0
        self.policy_version = 0
        self.sft_done = False
        self.last_checkpoint: Path | None = None
        self.last_metrics: dict[str, float] = {}
        self._policy_dir: Path | None = self.model_folder
        if not self.dp.is_main:  # rank 0 reports for all ranks
            metrics_sink, write_metrics = None, False
        if metrics_sink is None and write_metrics:
            metrics_sink = MetricsSink(
                config.run_dir, config.run, tensorboard=config.tensorboard, otel=config.otel_metrics
            )
        self.sink = metrics_sink

    # ------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------

    def _pick_device(self) -> torch.device:
        if self.config.device:
            return torch.device(self.config.device)
        if self.config.gpus > 0 and torch.cuda.is_available():
            return torch.device("cuda", self.dp.local_rank) if self.dp.enabled else torch.device("cuda")
        return torch.device("cpu")

    def _autocast_dtype(self) -> torch.dtype | None:
        """bf16 autocast when ``bf16`` and the parameters are float32, except on a CPU without bf16 units."""
        if not self.config.bf16 or self.param_dtype != torch.float32:
            return None
        if self.device.type == "cpu" and not cpu_has_bf16_units():
            if self.config.backend == "deepspeed":  # DeepSpeed's bf16 keeps bf16 weights: no autocast to skip
                log.warning("bf16 is set: DeepSpeed trains bf16 weights, which this CPU (no bf16 units) emulates")
                return None
            log.warning(
                "bf16 is set, but this CPU has no bf16 units (AVX512-BF16 or AMX): emulated bf16 would make the"
                " update several times slower (benchmarks/cpu_bf16_bench.py), so it computes in float32"
            )
            return None
        return torch.bfloat16

    def _param_dtype(self) -> torch.dtype:
        if self.device.type == "cpu":
            return torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.config.dtype]

    @property
    def attn_implementation(self) -> str:
        """The models' attention: ``sdpa_packed`` unless configured (registered with transformers here)."""
        kind = self.config.attn_implementation or PACKED_ATTENTION
        if kind == PACKED_ATTENTION:
            register_packed_attention()
        return kind

    def _load_lm(self, folder: Path) -> nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        kwargs: dict[str, Any] = {"dtype": self.param_dtype}
        kwargs["attn_implementation"] = self.attn_implementation
        model: nn.Module = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
        return model

    def _load_tokenizer(self) -> Any:
        folder = Path(self.config.tokenizer) if self.config.tokenizer else self.model_folder
        if folder is None or not (folder / "tokenizer.json").is_file():
            return None
        from agentgym.inference.models import load_tokenizer

        return load_tokenizer(folder)

    def _frozen_copy(self, module: nn.Module) -> nn.Module:
        ref = copy.deepcopy(module)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _build_critic(self) -> ValueModel:
        if self.model_folder is not None:
            critic = ValueModel.from_policy_folder(self.model_folder, self.param_dtype, self.attn_implementation)
        else:
            policy: Any = self.policy
            critic = ValueModel(copy.deepcopy(policy.get_decoder()), int(policy.config.hidden_size))
        critic.to(self.device)
        critic.train()
        if self.config.gradient_checkpointing:
            _enable_activation_checkpointing(critic.backbone)
        return critic

    def _build_engine(self) -> PolicyEngine:
        c = self.config
        settings = OptimizerSettings(c.learning_rate, c.adam_betas, c.adam_eps, c.weight_decay, c.max_grad_norm)
        if c.backend == "deepspeed":
            from agentgym.trainer.deepspeed_backend import DeepSpeedEngine

            return DeepSpeedEngine(self.policy, settings, c, world_size=self.dp.world_size)
        return TorchEngine(self.policy, settings)

    # ------------------------------------------------------------------------------------------
    # properties
    # ------------------------------------------------------------------------------------------

    @property
    def current_policy_dir(self) -> Path | None:
        """The HF folder holding the current policy weights (what inference should load)."""
        return self._policy_dir

    @property
    def horizon(self) -> int:
        return self.schedule.current_horizon

    # ------------------------------------------------------------------------------------------
    # batches
    # ------------------------------------------------------------------------------------------

    def _batch(self, trajectories: Sequence[rl_pb2.Trajectory]) -> _Batch:
        seqs = [list(t.prompt_token_ids) + list(t.response_token_ids) for t in trajectories]
        starts = [len(t.prompt_token_ids) for t in trajectories]
        lengths = [len(t.response_token_ids) for t in trajectories]
        width = max(lengths, default=0)
        mask = torch.zeros(len(trajectories), width)
        sampled = torch.zeros(len(trajectories), width)
        for b, t in enumerate(trajectories):
            n = lengths[b]
            if n:
                mask[b, :n] = torch.tensor(list(t.loss_mask), dtype=torch.float32)
                sampled[b, :n] = torch.tensor(list(t.sampled_logprobs), dtype=torch.float32)
        sampled = sampled * mask
        return _Batch(list(trajectories), seqs, starts, mask, sampled, lengths)

    def _shares_prompts(self) -> bool:
        """Whether rows may share prompts: every model that reads them takes a dense attention mask."""
        models = [m for m in (self.policy, self.reference, self.critic) if m is not None]
        dense = all(attention_kind(m) in (PACKED_ATTENTION, "sdpa", "eager") for m in models)
        return self.config.share_prompts and dense

    def _pack(self, batch: _Batch, indices: Sequence[int]) -> list[tuple[PackedRow, list[int]]]:
        """Rows for ``indices`` of ``batch``; each with the batch indices of its segments."""
        rows = pack_sequences(
            [batch.sequences[i] for i in indices],
            [batch.starts[i] for i in indices],
            self.config.micro_batch_tokens,
            score_masks=[batch.mask[i, : batch.lengths[i]] != 0 for i in indices],
            share_prompts=self._shares_prompts(),
            share_prefixes=self.config.share_prompt_prefixes,
        )
        return [(row, [indices[s.index] for s in row.segments]) for row in rows]

    def _forward(self, model: nn.Module, row: PackedRow, with_entropy: bool) -> SequenceOutputs:
        return forward_packed(
            model,
            row,
            with_entropy=with_entropy,
            entropy_grad=self.config.entropy_coef != 0.0,
            chunk_tokens=self.config.logits_chunk_tokens,
            checkpoint_chunks=self.config.gradient_checkpointing,
            autocast_dtype=self.autocast_dtype,
        )

    def _scatter(self, values: list[Tensor], lengths: Sequence[int], rows: int, width: int) -> Tensor:
        out = torch.zeros(rows, width)
        for b, v in enumerate(values):
            out[b, : lengths[b]] = v.detach().float().cpu()
        return out

    def _my_rows(self, rows: list[tuple[PackedRow, list[int]]]) -> list[tuple[PackedRow, list[int]] | None]:
        """This rank's share of ``rows``, balanced by tokens (all of them on one rank); None: an idle pass."""
        return self.dp.shard(rows, [row.num_tokens for row, _ in rows])

    def _idle_row(self) -> PackedRow:
        """A two-token row: what a rank short of rows forwards while the others work on theirs."""
        return pack_sequences([[0, 0]], [1], self.config.micro_batch_tokens)[0]

    def _idle_backward(self, last: bool) -> None:
        """A zero-weighted forward and backward of :meth:`_idle_row`: every parameter gets a zero gradient, so
        DeepSpeed's collectives (ZeRO-3's parameter gathers, the gradient reductions) pair up with the other
        ranks' passes at the cost of two tokens."""
        out = self._forward(self.policy, self._idle_row(), with_entropy=False)
        self.engine.backward(torch.stack([lp.sum() for lp in out.logprobs]).sum() * 0.0, last)

    def _gathered(self, local: dict[int, Tensor], batch: _Batch) -> Tensor:
        """``[B, T]`` from each rank's ``{batch index: per-token values}`` of its rows."""
        result: list[Tensor] = [torch.zeros(0)] * batch.size
        parts = self.dp.gather({b: v.detach().float().cpu() for b, v in local.items()}) if self.dp.enabled else [local]
        for part in parts:
            for b, v in part.items():
                result[b] = v
        return self._scatter(result, batch.lengths, batch.size, batch.mask.shape[1]) * batch.mask

    @torch.no_grad()
    def _logprobs_of(self, model: nn.Module, batch: _Batch) -> Tensor:
        """``[B, T]`` log-probs of the response tokens under ``model`` (no gradient); rows split over the ranks."""
        local: dict[int, Tensor] = {}
        rows = self._pack(batch, list(range(batch.size)))
        was_training = model.training
        model.eval()
        try:
            for entry in self._my_rows(rows):
                if entry is None:
                    if model is self.policy:  # ZeRO-3 gathers the policy's parameters in every rank's forward
                        self._forward(model, self._idle_row(), with_entropy=False)
                    continue
                row, idx = entry
                out = self._forward(model, row, with_entropy=False)
                local.update(zip(idx, out.logprobs, strict=True))
        finally:
            model.train(was_training)
        return self._gathered(local, batch)

    @torch.no_grad()
    def _values_of(self, batch: _Batch) -> Tensor:
        assert self.critic is not None
        local: dict[int, Tensor] = {}
        for entry in self._my_rows(self._pack(batch, list(range(batch.size)))):
            if entry is not None:  # the critic is a plain module: no collective to pair up
                row, idx = entry
                local.update(zip(idx, self.critic.values(row, self.autocast_dtype), strict=True))
        return self._gathered(local, batch)

    # ------------------------------------------------------------------------------------------
    # the RL step
    # ------------------------------------------------------------------------------------------

    def filter_new(self, trajectories: Sequence[rl_pb2.Trajectory]) -> tuple[list[rl_pb2.Trajectory], int]:
        """Trajectories whose ids were not seen before (nor earlier in the list); and the duplicate count."""
        fresh: list[rl_pb2.Trajectory] = []
        batch_ids: set[str] = set()
        duplicates = 0
        for t in trajectories:
            tid = t.trajectory_id
            if tid and (tid in self.seen_ids or tid in batch_ids):
                duplicates += 1
                continue
            if tid:
                batch_ids.add(tid)
            fresh.append(t)
        return fresh, duplicates

    def train_step(
        self, trajectories: Sequence[rl_pb2.Trajectory], *, extra_counts: dict[str, int] | None = None
    ) -> StepMetrics:
        """One RL update from ``trajectories``; see the module docstring. Returns the step's metrics."""
        c = self.config
        started = time.perf_counter()
        step = self.step
        fresh, duplicates = self.filter_new(trajectories)
        valid: list[rl_pb2.Trajectory] = []
        malformed = 0
        for t in fresh:
            problem = _validate(t)
            if problem is None:
                valid.append(t)
            else:
                malformed += 1
                log.warning("dropping malformed trajectory %s: %s", t.trajectory_id, problem)
        reward_cfg = c.reward_config()
        env_stats = rollout_metrics(valid, reward_cfg)
        failed = [t for t in valid if t.termination == rl_pb2.TERMINATION_ERROR]
        used = [
            t for t in valid if (c.train_on_failed or t.termination != rl_pb2.TERMINATION_ERROR) and any(t.loss_mask)
        ]
        uniform: set[str] = set()
        if c.drop_uniform_groups:
            uniform = uniform_outcome_groups(used, [group_key(t) for t in used], reward_cfg)
            used = [t for t in used if group_key(t) not in uniform]
        counts = {
            "received": len(trajectories),
            "duplicates": duplicates,
            "malformed": malformed,
            "failed": len(failed),
            "uniform_groups": len(uniform),
            "used": len(used),
            **(extra_counts or {}),
        }
        train: dict[str, float] = {}
        if used and c.algorithm == "rft":
            train = self._rft_update(used, step)
        elif used and c.algorithm == "dpo":
            train = self._dpo_update(used, step)
        elif used:
            train = self._update(self._batch(used), step)
        else:
            log.warning("step %d: no trajectory to train on (%d received)", step, len(trajectories))
        staleness = [float(self.policy_version - t.policy_version) for t in valid]
        train["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
        train["step_time_s"] = time.perf_counter() - started
        train["learning_rate"] = self.engine.get_lr()

        all_stats = env_stats.get("all", {})
        horizon_used = self.schedule.current_horizon
        stage_used = self.schedule.stage
        self.schedule.update(
            step,
            {
                "success_rate": float(all_stats.get("success_rate", 0.0)),
                "truncation_rate": float(all_stats.get("truncation_rate", 0.0)),
                "reward_mean": float(all_stats.get("reward_mean", 0.0)),
            },
        )
        self.seen_ids.update(t.trajectory_id for t in fresh if t.trajectory_id)
        self.step += 1
        self.policy_version += 1
        metrics = StepMetrics(
            step=step,
            policy_version=self.policy_version,
            horizon=horizon_used,
            stage=stage_used,
            env=env_stats,
            train=train,
            counts=counts,
        )
        self.last_metrics = metrics.flat()
        if self.sink is not None:
            self.sink.write(step, {**metrics.as_record(), "next_horizon": self.schedule.current_horizon})
        return metrics

    def _advantages(
        self, batch: _Batch, old: Tensor, ref: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(advantages, returns, old values) ``[B, T]``; the last two for PPO only."""
        c = self.config
        mask = batch.mask
        kl_reward = None
        if c.kl_as == "reward" and ref is not None:
            kl_reward = kl_penalty(old, ref, c.kl_type) * mask
        if c.algorithm in ("grpo", "rloo"):
            scores = trajectory_scores(batch.trajectories, c.reward_config())
            group_ids = [group_key(t) for t in batch.trajectories]
            if c.algorithm == "grpo":
                outcome = adv.grpo_advantages(scores, group_ids, mask, c.normalize_by_std)
            else:
                outcome = adv.rloo_advantages(scores, group_ids, mask)
            outcome = adv.scale_negative_advantages(outcome, c.negative_advantage_scale)
            if c.turn_validity_coef:
                spans, invalid = zip(*(turn_validity(t) for t in batch.trajectories), strict=True)
                success = [t.success for t in batch.trajectories] if c.turn_validity_needs_success else None
                validity = adv.turn_validity_advantages(
                    spans, invalid, group_ids, mask, c.normalize_by_std, success=success
                )
                outcome = outcome + c.turn_validity_coef * validity
            if c.step_group_coef:
                rewards_config = c.reward_config()
                spans, states, turn_rewards = zip(
                    *(turn_states(t, rewards_config) for t in batch.trajectories), strict=True
                )
                step_level = adv.step_group_advantages(
                    spans, states, turn_rewards, group_ids, mask, c.step_group_gamma, c.normalize_by_std
                )
                outcome = outcome + c.step_group_coef * step_level
            return outcome, None, None
        rewards = token_rewards(batch.trajectories, mask, c.reward_config())
        if c.algorithm == "reinforce_plus_plus":
            coef = c.kl_coef if kl_reward is not None else 0.0
            advantages = adv.reinforce_plus_plus_advantages(rewards, mask, c.gamma, kl_reward, coef)
            return adv.scale_negative_advantages(advantages, c.negative_advantage_scale), None, None
        if kl_reward is not None:
            rewards = adv.kl_penalized_rewards(rewards, mask, kl_reward, c.kl_coef)
        values = self._values_of(batch)
        advantages, returns = adv.gae_advantages(rewards, values, mask, c.gamma, c.lam)
        return adv.scale_negative_advantages(advantages, c.negative_advantage_scale), returns, values

    def _update(self, batch: _Batch, step: int) -> dict[str, float]:
        c = self.config
        mask = batch.mask
        sampled = batch.sampled_logprobs
        ref = self._logprobs_of(self.reference, batch) if self.reference is not None else None
        diff_max = diff_mean = None
        if c.recompute_old_logprobs:
            old = self._logprobs_of(self.policy, batch)
            diff = (old - sampled).abs() * mask
            diff_max = float(diff.max()) if diff.numel() else 0.0
            diff_mean = float(diff.sum() / mask.sum().clamp(min=1))
        else:
            old = sampled
        advantages, returns, old_values = self._advantages(batch, old, ref)

        sums: dict[str, float] = {}
        weights: dict[str, float] = {}

        def add(name: str, value: float, weight: float) -> None:
            sums[name] = sums.get(name, 0.0) + value * weight
            weights[name] = weights.get(name, 0.0) + weight

        grad_norms: list[float] = []
        critic_norms: list[float] = []
        tokens_processed = 0
        first_diff: list[Tensor] = []
        first_count = 0.0
        compute_started = time.perf_counter()
        generator = torch.Generator().manual_seed(_seed_for(c.seed, "minibatch", step))
        for epoch in range(c.epochs):
            order = mini_batch_order(
                [group_key(t) for t in batch.trajectories], generator, by_group=c.mini_batches_by_group
            )
            for start in range(0, batch.size, c.mini_batch_size):
                members = order[start : start + c.mini_batch_size]
                rows = self._pack(batch, members)
                mb_tokens = float(mask[members].sum())
                mb_seqs = float((mask[members].sum(dim=1) > 0).sum())
                measure = epoch == 0 and start == 0 and not c.recompute_old_logprobs
                mine = self._my_rows(rows)
                for r, entry in enumerate(mine):
                    last = r == len(mine) - 1
                    if entry is None:  # this rank has fewer rows than another
                        self._idle_backward(last)
                        continue
                    row, idx = entry
                    fwd = self._forward(self.policy, row, with_entropy=True)
                    width = max(batch.lengths[b] for b in idx)
                    lp = pad_sequence(fwd.logprobs, batch_first=True)[:, :width]
                    ent = pad_sequence(fwd.entropy or [], batch_first=True)[:, :width]
                    m = mask[idx, :width].to(lp.device)
                    row_tokens = float(m.sum())
                    if c.loss_aggregation == "token-mean":
                        weight = row_tokens / max(mb_tokens, 1.0)
                    else:
                        weight = float((m.sum(dim=1) > 0).sum()) / max(mb_seqs, 1.0)
                    pg, stats = policy_loss(
                        lp,
                        old[idx, :width].to(lp.device),
                        advantages[idx, :width].to(lp.device),
                        m,
                        clip_low=c.clip_low,
                        clip_high=c.clip_high,
                        aggregation=c.loss_aggregation,
                        dual_clip=c.dual_clip,
                    )
                    loss = pg
                    entropy = aggregate_loss(ent, m, c.loss_aggregation)
                    if c.entropy_coef:
                        loss = loss - c.entropy_coef * entropy
                    if ref is not None:
                        kl = kl_loss(lp, ref[idx, :width].to(lp.device), m, c.kl_type, c.loss_aggregation)
                        if c.kl_as == "loss":
                            loss = loss + c.kl_coef * kl
                        add("kl", float(kl.detach()), row_tokens)
                    # DeepSpeed averages the ranks' gradients: x world makes it their sum, the full mini-batch's
                    self.engine.backward(loss * (weight * self.dp.world_size), last)
                    tokens_processed += row.num_tokens
                    if measure:
                        first_diff.append(((lp.detach().cpu() - sampled[idx, :width]).abs() * m.cpu()).flatten())
                        first_count += row_tokens
                    add("policy_loss", float(pg.detach()), row_tokens)
                    add("entropy", float(entropy.detach()), row_tokens)
                    for name, value in stats.as_dict().items():
                        add(name, value, row_tokens)
                grad_norms.append(self.engine.step())
                if self.critic is not None and self.critic_engine is not None:
                    assert returns is not None and old_values is not None
                    mine = self._my_rows(rows)
                    for r, entry in enumerate(mine):
                        if entry is None:  # the critic trains outside DeepSpeed: its gradients are summed below
                            continue
                        row, idx = entry
                        width = max(batch.lengths[b] for b in idx)
                        values = pad_sequence(self.critic.values(row, self.autocast_dtype), batch_first=True)[:, :width]
                        m = mask[idx, :width].to(values.device)
                        row_tokens = float(m.sum())
                        if c.loss_aggregation == "token-mean":
                            weight = row_tokens / max(mb_tokens, 1.0)
                        else:
                            weight = float((m.sum(dim=1) > 0).sum()) / max(mb_seqs, 1.0)
                        vl, vstats = value_loss(
                            values,
                            old_values[idx, :width].to(values.device),
                            returns[idx, :width].to(values.device),
                            m,
                            clip_range=c.value_clip,
                            aggregation=c.loss_aggregation,
                        )
                        self.critic_engine.backward(vl * weight, r == len(mine) - 1)
                        add("value_loss", float(vl.detach()), row_tokens)
                        for name, value in vstats.as_dict().items():
                            add(f"value_{name}" if not name.startswith("value") else name, value, row_tokens)
                    self.dp.sum_gradients(self.critic.parameters())
                    critic_norms.append(self.critic_engine.step())
        elapsed = time.perf_counter() - compute_started
        d = torch.cat(first_diff) if first_diff else torch.zeros(0)
        local_diff = (float(d.max()) if d.numel() else 0.0, float(d.sum()), first_count)
        # Each rank measured its own rows: sum the weighted sums, tokens and engine/trainer gaps over the ranks.
        parts = self.dp.gather((sums, weights, tokens_processed, local_diff, elapsed))
        total_sums: dict[str, float] = {}
        total_weights: dict[str, float] = {}
        for part_sums, part_weights, _, _, _ in parts:
            for name in part_sums:
                total_sums[name] = total_sums.get(name, 0.0) + part_sums[name]
                total_weights[name] = total_weights.get(name, 0.0) + part_weights[name]
        tokens_processed = sum(part[2] for part in parts)
        elapsed = max(part[4] for part in parts)
        diffs = [part[3] for part in parts if part[3][2] > 0]
        out = {name: total_sums[name] / w if (w := total_weights[name]) else 0.0 for name in total_sums}
        if diff_max is None and diffs:
            diff_max = max(diff[0] for diff in diffs)
            diff_mean = sum(diff[1] for diff in diffs) / sum(diff[2] for diff in diffs)
        out["logprob_diff_max"] = diff_max or 0.0
        out["logprob_diff_mean"] = diff_mean or 0.0
        out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        out["grad_norm_max"] = max(grad_norms, default=0.0)
        if critic_norms:
            out["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
        out["optimizer_steps"] = float(len(grad_norms))
        out["tokens_per_s"] = tokens_processed / elapsed if elapsed > 0 else 0.0
        out["tokens"] = float(tokens_processed)
        out["sampled_tokens"] = float(mask.sum())
        sampled_adv = advantages[mask != 0]
        out["advantage_mean"] = float(sampled_adv.mean()) if sampled_adv.numel() else 0.0
        out["advantage_std"] = float(sampled_adv.std()) if sampled_adv.numel() > 1 else 0.0
        return out

    def _chunks(self, count: int, size: int, step: int, kind: str) -> list[list[int]]:
        """``epochs`` seeded shuffles of ``range(count)``, each cut into chunks of ``size``: one optimiser step each."""
        generator = torch.Generator().manual_seed(_seed_for(self.config.seed, kind, step))
        chunks = []
        for _ in range(self.config.epochs):
            order = torch.randperm(count, generator=generator).tolist()
            chunks += [order[start : start + size] for start in range(0, count, size)]
        return chunks

    def _rft_update(self, trajectories: Sequence[rl_pb2.Trajectory], step: int) -> dict[str, float]:
        """Rejection-sampling fine-tuning (``algorithm: rft``): token-mean cross-entropy on the sampled tokens of
        the successful trajectories, ``mini_batch_size`` of them per optimiser step, at ``learning_rate``.

        ``L = -(1 / |T|) sum_{t in T} log pi(a_t | s_t)`` over T, the action tokens of the successes.
        """
        examples = self.rejection_sampling_examples(trajectories)
        out: dict[str, float] = {"rft_examples": float(len(examples)), "optimizer_steps": 0.0}
        if not examples:
            return out
        history = [
            self.sft_step([examples[i] for i in chunk], learning_rate=self.config.learning_rate)
            for chunk in self._chunks(len(examples), self.config.mini_batch_size, step, "rft")
        ]
        out["optimizer_steps"] = float(len(history))
        out["sft_loss"] = sum(h["sft_loss"] for h in history) / len(history)
        out["grad_norm"] = sum(h["grad_norm"] for h in history) / len(history)
        out["tokens"] = sum(h["tokens"] for h in history)
        return out

    def _dpo_update(self, trajectories: Sequence[rl_pb2.Trajectory], step: int) -> dict[str, float]:
        """Online DPO (``algorithm: dpo``): each group's best trajectory against its worst (:meth:`dpo_pairs`),
        ``mini_batch_size / 2`` pairs per optimiser step; the loss is in :func:`agentgym.trainer.losses.dpo_loss`."""
        pairs = self.dpo_pairs(trajectories)
        out: dict[str, float] = {"dpo_pairs": float(len(pairs)), "optimizer_steps": 0.0}
        if not pairs:
            return out
        history = [
            self.dpo_step([pairs[i] for i in chunk], beta=self.config.dpo_beta)
            for chunk in self._chunks(len(pairs), max(1, self.config.mini_batch_size // 2), step, "dpo")
        ]
        out["optimizer_steps"] = float(len(history))
        for name in ("dpo_loss", "reward_margin", "reward_accuracy", "grad_norm"):
            out[name] = sum(h[name] for h in history) / len(history)
        return out

    # ------------------------------------------------------------------------------------------
    # supervised: SFT warm-up, rejection sampling, DPO
    # ------------------------------------------------------------------------------------------

    def _example_batch(self, examples: Sequence[SFTExample]) -> _Batch:
        trajectories = [
            rl_pb2.Trajectory(
                prompt_token_ids=e.prompt_ids,
                response_token_ids=e.response_ids,
                loss_mask=e.loss_mask,
                sampled_logprobs=[0.0] * len(e.response_ids),
                environment=e.environment,
                task_id=e.task_id,
            )
            for e in examples
        ]
        return self._batch(trajectories)

    def sft_step(self, examples: Sequence[SFTExample], learning_rate: float | None = None) -> dict[str, float]:
        """One optimiser step of token-mean cross-entropy on the examples' masked-in tokens."""
        if not examples:
            raise ValueError("sft_step needs at least one example")
        batch = self._example_batch(examples)
        lr_before = self.engine.get_lr()
        self.engine.set_lr(self.config.sft_learning_rate if learning_rate is None else learning_rate)
        try:
            total = float(batch.mask.sum())
            loss_sum = 0.0
            rows = self._pack(batch, list(range(batch.size)))
            started = time.perf_counter()
            tokens = 0
            mine = self._my_rows(rows)
            for r, entry in enumerate(mine):
                if entry is None:  # this rank has fewer rows than another (see _update)
                    self._idle_backward(r == len(mine) - 1)
                    continue
                row, idx = entry
                out = self._forward(self.policy, row, with_entropy=False)
                width = max(batch.lengths[b] for b in idx)
                lp = pad_sequence(out.logprobs, batch_first=True)[:, :width]
                m = batch.mask[idx, :width].to(lp.device)
                nll = -(lp * m).sum() / max(total, 1.0)
                self.engine.backward(nll * self.dp.world_size, r == len(mine) - 1)  # a sum over the ranks, see _update
                loss_sum += float(nll.detach())
                tokens += row.num_tokens
            grad_norm = self.engine.step()
            elapsed = time.perf_counter() - started
            if self.dp.enabled:
                parts = self.dp.gather((loss_sum, tokens, elapsed))
                loss_sum, tokens = sum(part[0] for part in parts), sum(part[1] for part in parts)
                elapsed = max(part[2] for part in parts)
        finally:
            self.engine.set_lr(lr_before)
        return {
            "sft_loss": loss_sum,
            "grad_norm": grad_norm,
            "tokens": float(tokens),
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "sampled_tokens": total,
        }

    def sft(
        self,
        examples: Sequence[SFTExample],
        steps: int,
        batch_size: int | None = None,
        *,
        mark_done: bool = True,
        reset_optimizer: bool | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[dict[str, float]]:
        """``steps`` SFT optimiser steps over ``examples`` (reshuffled each pass, seeded); bumps the policy version.

        The warm-up (``mark_done``) is a stage of its own: afterwards the optimiser's state is reset
        (``reset_optimizer``, default ``mark_done``), so RL starts with a fresh AdamW. Carried over, the
        SFT's second-moment estimates (cross-entropy gradients, far larger than policy-gradient ones,
        decaying over ~1 / (1 - beta2) = 1000 steps) would shrink every RL update for hundreds of steps,
        and its first moments would push RL's first steps along the SFT's direction.

        ``should_stop`` is asked before every step (a run being stopped); once it answers True the
        warm-up ends there unfinished: not marked done, no new policy version, so a resume redoes it.
        """
        if steps < 0:
            raise ValueError("steps must be >= 0")
        if not examples:
            raise ValueError("no SFT examples")
        size = batch_size or self.config.sft_batch_size
        generator = torch.Generator().manual_seed(_seed_for(self.config.seed, "sft", self.policy_version))
        order: list[int] = []
        history: list[dict[str, float]] = []
        for k in range(steps):
            # Rank 0's answer for every rank: they stop together, or none does.
            if self.dp.broadcast(should_stop is not None and should_stop()):
                log.info("SFT stopped after %d of %d steps", k, steps)
                return history
            if len(order) < size:
                order += torch.randperm(len(examples), generator=generator).tolist()
            chosen, order = order[:size], order[size:]
            metrics = self.sft_step([examples[i] for i in chosen])
            metrics["sft_step"] = float(k)
            history.append(metrics)
            if self.sink is not None:
                self.sink.write(self.step, {f"sft/{k2}": v for k2, v in metrics.items()})
        if steps:
            self.policy_version += 1
        if mark_done:
            self.sft_done = True
            if steps:
                self._adopt_policy_as_reference()
        if steps and (mark_done if reset_optimizer is None else reset_optimizer):
            self.engine.reset_optimizer_state()
        return history

    def _adopt_policy_as_reference(self) -> None:
        """After the SFT warm-up the KL anchor is the warmed-up policy, RL's starting point.

        Anchoring to the raw model instead would pull RL back towards what the warm-up just trained
        away (for a model trained from scratch: towards random weights). The reference is saved once
        to ``<output_dir>/reference`` and named in every later checkpoint, so a resume restores it.
        """
        if self.reference is None:
            return
        folder = self.config.run_dir / "reference"
        with self._atomic_directory(folder) as tmp:
            self._save_policy(tmp)
        self.reference = self._frozen_copy(self._load_lm(folder).to(self.device))
        self.reference_dir = folder

    @staticmethod
    def rejection_sampling_examples(
        trajectories: Sequence[rl_pb2.Trajectory], *, require_success: bool = True, min_score: float | None = None
    ) -> list[SFTExample]:
        """Rejection-sampling fine-tuning data: the sampled tokens of successful (or high-scoring) trajectories."""
        examples = []
        for t in trajectories:
            if t.termination == rl_pb2.TERMINATION_ERROR or _validate(t) is not None or not any(t.loss_mask):
                continue
            if require_success and not t.success:
                continue
            if min_score is not None and t.final_score < min_score:
                continue
            examples.append(
                SFTExample(
                    list(t.prompt_token_ids), list(t.response_token_ids), list(t.loss_mask), t.environment, t.task_id
                )
            )
        return examples

    def rejection_sampling_step(self, trajectories: Sequence[rl_pb2.Trajectory]) -> dict[str, float] | None:
        """One SFT step on the successful trajectories (None when there is none)."""
        examples = self.rejection_sampling_examples(trajectories)
        if not examples:
            return None
        return self.sft_step(examples)

    @staticmethod
    def dpo_pairs(trajectories: Sequence[rl_pb2.Trajectory]) -> list[DPOPair]:
        """Per group: the best trajectory (by score, success first) against the worst, when they differ."""
        groups: dict[str, list[rl_pb2.Trajectory]] = {}
        for t in trajectories:
            if t.termination == rl_pb2.TERMINATION_ERROR or _validate(t) is not None or not any(t.loss_mask):
                continue
            groups.setdefault(t.group_id or t.task_id, []).append(t)
        pairs = []
        for key in sorted(groups):
            ranked = sorted(groups[key], key=lambda t: (t.success, t.final_score), reverse=True)
            best, worst = ranked[0], ranked[-1]
            if (best.success, best.final_score) == (worst.success, worst.final_score):
                continue
            pairs.append(
                DPOPair(
                    SFTExample(list(best.prompt_token_ids), list(best.response_token_ids), list(best.loss_mask)),
                    SFTExample(list(worst.prompt_token_ids), list(worst.response_token_ids), list(worst.loss_mask)),
                )
            )
        return pairs

    def dpo_step(
        self, pairs: Sequence[DPOPair], beta: float = 0.1, learning_rate: float | None = None
    ) -> dict[str, float]:
        """One DPO optimiser step on trajectory pairs (sequence log-prob = sum over sampled tokens)."""
        if not pairs:
            raise ValueError("dpo_step needs at least one pair")
        if self.reference is None:
            self.reference = self._reference_from_initial()
        examples = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        batch = self._example_batch(examples)
        n = len(pairs)
        ref_lp = (self._logprobs_of(self.reference, batch) * batch.mask).sum(dim=1)
        lr_before = self.engine.get_lr()
        self.engine.set_lr(self.config.learning_rate if learning_rate is None else learning_rate)
        try:
            seq_lp: list[Tensor] = [torch.zeros(())] * batch.size
            rows = self._pack(batch, list(range(batch.size)))
            # DPO couples chosen and rejected through the sigmoid: forward all rows, then one backward.
            for row, idx in rows:
                out = self._forward(self.policy, row, with_entropy=False)
                for b, lp in zip(idx, out.logprobs, strict=True):
                    seq_lp[b] = (lp * batch.mask[b, : batch.lengths[b]].to(lp.device)).sum()
            stacked = torch.stack(seq_lp)
            dev = stacked.device
            loss, r_c, r_r = dpo_loss(stacked[:n], stacked[n:], ref_lp[:n].to(dev), ref_lp[n:].to(dev), beta=beta)
            self.engine.backward(loss, True)
            grad_norm = self.engine.step()
        finally:
            self.engine.set_lr(lr_before)
        return {
            "dpo_loss": float(loss.detach()),
            "reward_margin": float((r_c - r_r).mean()),
            "reward_accuracy": float((r_c > r_r).float().mean()),
            "grad_norm": grad_norm,
        }

    def _reference_from_initial(self) -> nn.Module:
        if self.model_folder is None:
            raise ValueError("a reference model needs kl_coef > 0 at construction or a model folder")
        return self._frozen_copy(self._load_lm(self.model_folder).to(self.device))

    # ------------------------------------------------------------------------------------------
    # checkpoints and weights
    # ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _atomic_directory(self, final: Path) -> Iterator[Path]:
        """:class:`atomic_directory` for every rank: rank 0 makes the temporary folder and renames it into
        place once all ranks have written their parts (each rank's optimizer partition, under DeepSpeed)."""
        if not self.dp.enabled:
            with atomic_directory(final) as tmp:
                yield tmp
            return
        if self.dp.is_main:
            with atomic_directory(final) as tmp:
                self.dp.broadcast(str(tmp))
                yield tmp
                self.dp.barrier()  # every rank has written into tmp
        else:
            yield Path(self.dp.broadcast())
            self.dp.barrier()
        self.dp.barrier()  # renamed: every rank may read `final`

    def _save_policy(self, folder: Path) -> None:
        """The policy's HF folder (and tokenizer); every rank calls it, rank 0 writes."""
        save = getattr(self.engine, "save_hf_model", None)
        if save is not None:
            save(folder)  # gathers ZeRO-3's partitions (a collective), writes on rank 0
        else:
            save_pretrained = getattr(self.policy, "save_pretrained", None)
            if save_pretrained is None:
                raise TypeError("the policy cannot save_pretrained")
            save_pretrained(str(folder))
        self._save_tokenizer(folder)

    def _save_tokenizer(self, folder: Path) -> None:
        if not self.dp.is_main:
            return
        source = Path(self.config.tokenizer) if self.config.tokenizer else self.model_folder
        if source is not None and (source / "tokenizer.json").is_file():
            import shutil

            for name in _TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, folder / name)
        elif self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(str(folder))

    def state_dict(self) -> dict[str, Any]:
        """The JSON-able trainer state (``trainer_state.json``)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "policy_version": self.policy_version,
            "sft_done": self.sft_done,
            "reference_dir": str(self.reference_dir) if self.reference_dir is not None else None,
            "curriculum": self.schedule.state_dict(),
            "curriculum_state": self.schedule.state().to_dict(),
            "seen_trajectory_ids": self.seen_ids.to_list(),
            "metrics": self.last_metrics,
            "config": self.config.to_dict(),
            "created_at": time.time(),
        }

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Save ``<directory>/step-<step>/`` atomically (default directory: ``<output_dir>/checkpoints``).

        Older checkpoints beyond ``keep_checkpoints`` are pruned. The saved folder becomes
        :attr:`current_policy_dir`.
        """
        root = Path(directory) if directory is not None else self.config.checkpoint_dir
        final = root / f"step-{self.step}"
        with self._atomic_directory(final) as tmp:
            self._save_policy(tmp)
            save_engine_state = getattr(self.engine, "save_engine_state", None)
            if save_engine_state is not None:  # DeepSpeed: partitioned optimizer state, its own format
                save_engine_state(tmp / "engine")  # every rank writes its partition
            if self.dp.is_main:  # the rest is the same on every rank: rank 0 writes it
                optimizer_state = {
                    "policy": None if save_engine_state is not None else self.engine.optimizer_state(),
                    "critic": self.critic_engine.optimizer_state() if self.critic_engine is not None else None,
                }
                torch.save(optimizer_state, tmp / "optimizer.pt")
                torch.save(capture_rng_state(), tmp / "rng.pt")
                if self.critic is not None:
                    self.critic.save(tmp / "critic")
                (tmp / STATE_FILE).write_text(json.dumps(self.state_dict(), indent=1, default=float))
        if self.dp.is_main:
            prune_checkpoints(root, self.config.keep_checkpoints, protect=[final])
        self.last_checkpoint = final
        self._policy_dir = final
        return final

    def export_weights(self, directory: str | Path | None = None) -> Path:
        """Write the current policy (HF folder) to ``<directory>/version-<policy_version>`` for inference."""
        root = Path(directory) if directory is not None else self.config.weights_dir
        final = root / f"version-{self.policy_version}"
        with self._atomic_directory(final) as tmp:
            self._save_policy(tmp)
        self._policy_dir = final
        if not self.dp.is_main:
            return final
        versions = sorted(
            (int(p.name.split("-", 1)[1]), p)
            for p in root.iterdir()
            if p.is_dir() and p.name.startswith("version-") and p.name.split("-", 1)[1].isdigit()
        )
        import shutil

        for _, path in versions[: -self.config.keep_checkpoints]:
            if path != final:
                shutil.rmtree(path, ignore_errors=True)
        return final

    def load_checkpoint(self, directory: str | Path) -> Path:
        """Restore from a ``step-<n>`` folder, or the newest one under ``directory``; returns the folder."""
        path = latest_checkpoint(directory)
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        state = json.loads((path / STATE_FILE).read_text())
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: unsupported checkpoint format {state.get('format')!r}")
        load = getattr(self.engine, "load_hf_model", None)
        if load is not None:
            load(path)
        else:
            load_hf_weights(self.policy, path)
        optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        load_engine_state = getattr(self.engine, "load_engine_state", None)
        if load_engine_state is not None:
            load_engine_state(path / "engine")
        else:
            self.engine.load_optimizer_state(optimizer_state["policy"])
        # The optimiser state carries the learning rate it was saved with (e.g. an `agentgym sft` run's, or
        # before the spec changed); the config is the source of truth (there is no schedule to resume).
        self.engine.set_lr(self.config.learning_rate)
        if self.critic is not None and self.critic_engine is not None:
            if not (path / "critic").is_dir() or optimizer_state.get("critic") is None:
                raise ValueError(f"{path} has no critic (needed for ppo)")
            self.critic.load(path / "critic")
            self.critic_engine.load_optimizer_state(optimizer_state["critic"])
            self.critic_engine.set_lr(self.config.critic_learning_rate)
        self.schedule.load_state_dict(state["curriculum"])
        self.seen_ids.replace(state.get("seen_trajectory_ids", []))
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])
        self.sft_done = bool(state.get("sft_done", False))
        reference_dir = state.get("reference_dir")
        if reference_dir and self.config.uses_reference:
            if not (Path(reference_dir) / "config.json").is_file():
                raise ValueError(f"{path} names the KL reference {reference_dir}, which is missing")
            self.reference = self._frozen_copy(self._load_lm(Path(reference_dir)).to(self.device))
            self.reference_dir = Path(reference_dir)
        self.last_metrics = {str(k): float(v) for k, v in dict(state.get("metrics", {})).items()}
        restore_rng_state(torch.load(path / "rng.pt", map_location="cpu", weights_only=False))
        self.last_checkpoint = path
        self._policy_dir = path
        return path

    def renumber_policy(self, version: int) -> None:
        """Give the current weights a higher policy version: after a resume from a checkpoint older than the
        last version published (weights-only exports since then were lost with the process), so versions only
        go up and no server or status takes the checkpoint's weights for an older or a lost policy."""
        if version < self.policy_version:
            raise ValueError(f"policy versions only go up: {version} < {self.policy_version}")
        self.policy_version = version

    def maybe_resume(self, directory: str | Path | None = None) -> Path | None:
        """Load the newest checkpoint under ``directory`` (default: the run's) if there is one."""
        root = Path(directory) if directory is not None else self.config.checkpoint_dir
        loaded = self.load_checkpoint(root) if latest_checkpoint(root) is not None else None
        if self.sink is not None:  # what an earlier process trained after its last checkpoint is trained again
            dropped = self.sink.forget_from(self.step, sft_committed=self.sft_done)
            if dropped:
                log.info("at step %d: dropped %d metrics lines of uncommitted steps", self.step, dropped)
        return loaded

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
