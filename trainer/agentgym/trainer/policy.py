"""The models a step trains and reads, and how they are run over packed rows.

:class:`Policy` holds the policy (and its optimiser engine), the frozen reference, PPO's critic
(and its engine) and the tokenizer; it picks the device, parameter dtype and autocast; it packs a
:class:`~agentgym.trainer.batch.TrainBatch` into rows (``agentgym.trainer.packing``), forwards
them, and under data parallelism gives each rank its share of the rows and gathers the per-token
results of all ranks (``agentgym.trainer.distributed``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from agentgym.allocator import retain_freed_memory
from agentgym.cpus import cpu_has_bf16_units
from agentgym.trainer.backend import OptimizerSettings, PolicyEngine, TorchEngine
from agentgym.trainer.batch import TrainBatch
from agentgym.trainer.config import RLTrainerConfig
from agentgym.trainer.critic import ValueModel
from agentgym.trainer.distributed import DataParallel
from agentgym.trainer.packed_attention import PACKED_ATTENTION, register_packed_attention
from agentgym.trainer.packing import PackedRow, SequenceOutputs, attention_kind, forward_packed, pack_sequences

log = logging.getLogger(__name__)

__all__ = ["Policy", "Rows", "cpu_has_bf16_units"]

Rows = list[tuple[PackedRow, list[int]]]
"""Packed rows, each with the batch indices of its segments."""

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def enable_activation_checkpointing(model: nn.Module) -> None:
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


def frozen_copy(module: nn.Module) -> nn.Module:
    ref = copy.deepcopy(module)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _resolve_model_folder(name: str) -> Path:
    from agentgym.inference.models import resolve_model

    return Path(resolve_model(name))


def _optimizer_settings(config: RLTrainerConfig, learning_rate: float) -> OptimizerSettings:
    c = config
    return OptimizerSettings(learning_rate, c.adam_betas, c.adam_eps, c.weight_decay, c.max_grad_norm)


class Policy:
    """The policy and its optimiser, the reference, the critic, the tokenizer; forwards over packed rows."""

    def __init__(
        self,
        config: RLTrainerConfig,
        dp: DataParallel,
        *,
        model: nn.Module | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.config = config
        self.dp = dp
        self.device = self._pick_device()
        if self.device.type == "cpu":
            retain_freed_memory()  # the [tokens, vocab] logits and their gradients reuse freed buffers each step
        self.param_dtype = self._param_dtype()
        self.autocast_dtype = self._autocast_dtype()
        self.model_folder: Path | None = None
        if model is None:
            self.model_folder = _resolve_model_folder(config.model)
            model = self.load_lm(self.model_folder)
        self.model: nn.Module = model.to(self.device)
        self.model.train()
        if config.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.reference: nn.Module | None = frozen_copy(self.model) if config.uses_reference else None
        self.reference_dir: Path | None = None  # set once the SFT warm-up's policy is the reference
        self.critic: ValueModel | None = None
        if config.algorithm == "ppo":
            self.critic = self._build_critic()
            self.dp.broadcast_parameters(self.critic)  # every rank's critic starts from rank 0's
        self.engine: PolicyEngine = self._build_engine()
        self.critic_engine: TorchEngine | None = None
        if self.critic is not None:
            self.critic_engine = TorchEngine(self.critic, _optimizer_settings(config, config.critic_learning_rate))

    # -- construction ----------------------------------------------------------------------------

    def _pick_device(self) -> torch.device:
        if self.config.device:
            return torch.device(self.config.device)
        if self.config.gpus > 0 and torch.cuda.is_available():
            return torch.device("cuda", self.dp.local_rank) if self.dp.enabled else torch.device("cuda")
        return torch.device("cpu")

    def _param_dtype(self) -> torch.dtype:
        if self.device.type == "cpu":
            return torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.config.dtype]

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

    @property
    def attn_implementation(self) -> str:
        """The models' attention: ``sdpa_packed`` unless configured (registered with transformers here)."""
        kind = self.config.attn_implementation or PACKED_ATTENTION
        if kind == PACKED_ATTENTION:
            register_packed_attention()
        return kind

    def load_lm(self, folder: Path) -> nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        kwargs: dict[str, Any] = {"dtype": self.param_dtype, "attn_implementation": self.attn_implementation}
        model: nn.Module = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
        return model

    def load_reference(self, folder: Path) -> nn.Module:
        """A frozen model from an HF folder, on this device."""
        return frozen_copy(self.load_lm(folder).to(self.device))

    def reference_model(self) -> nn.Module:
        """The frozen reference; DPO without one made at construction anchors to the initial model."""
        if self.reference is None:
            if self.model_folder is None:
                raise ValueError("a reference model needs kl_coef > 0 at construction or a model folder")
            self.reference = self.load_reference(self.model_folder)
        return self.reference

    def _load_tokenizer(self) -> Any:
        folder = Path(self.config.tokenizer) if self.config.tokenizer else self.model_folder
        if folder is None or not (folder / "tokenizer.json").is_file():
            return None
        from agentgym.inference.models import load_tokenizer

        return load_tokenizer(folder)

    def _build_critic(self) -> ValueModel:
        if self.model_folder is not None:
            critic = ValueModel.from_policy_folder(self.model_folder, self.param_dtype, self.attn_implementation)
        else:
            policy: Any = self.model
            critic = ValueModel(copy.deepcopy(policy.get_decoder()), int(policy.config.hidden_size))
        critic.to(self.device)
        critic.train()
        if self.config.gradient_checkpointing:
            enable_activation_checkpointing(critic.backbone)
        return critic

    def _build_engine(self) -> PolicyEngine:
        settings = _optimizer_settings(self.config, self.config.learning_rate)
        if self.config.backend == "deepspeed":
            from agentgym.trainer.deepspeed_backend import DeepSpeedEngine

            return DeepSpeedEngine(self.model, settings, self.config, world_size=self.dp.world_size)
        return TorchEngine(self.model, settings)

    @contextlib.contextmanager
    def learning_rate(self, lr: float) -> Iterator[None]:
        """The policy's optimiser at ``lr`` inside the block (SFT, RFT and DPO steps), as before after it."""
        before = self.engine.get_lr()
        self.engine.set_lr(lr)
        try:
            yield
        finally:
            self.engine.set_lr(before)

    # -- packed forwards -------------------------------------------------------------------------

    def _shares_prompts(self) -> bool:
        """Whether rows may share prompts: every model that reads them takes a dense attention mask."""
        models = [m for m in (self.model, self.reference, self.critic) if m is not None]
        dense = all(attention_kind(m) in (PACKED_ATTENTION, "sdpa", "eager") for m in models)
        return self.config.share_prompts and dense

    def pack(self, batch: TrainBatch, indices: Sequence[int]) -> Rows:
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

    def forward(self, model: nn.Module, row: PackedRow, with_entropy: bool) -> SequenceOutputs:
        return forward_packed(
            model,
            row,
            with_entropy=with_entropy,
            entropy_grad=self.config.entropy_coef != 0.0,
            chunk_tokens=self.config.logits_chunk_tokens,
            checkpoint_chunks=self.config.gradient_checkpointing,
            autocast_dtype=self.autocast_dtype,
        )

    def my_rows(self, rows: Rows) -> list[tuple[PackedRow, list[int]] | None]:
        """This rank's share of ``rows``, balanced by tokens (all of them on one rank); None: an idle pass."""
        return self.dp.shard(rows, [row.num_tokens for row, _ in rows])

    def _idle_row(self) -> PackedRow:
        """A two-token row: what a rank short of rows forwards while the others work on theirs."""
        return pack_sequences([[0, 0]], [1], self.config.micro_batch_tokens)[0]

    def idle_backward(self, last: bool) -> None:
        """A zero-weighted forward and backward of a two-token row: every parameter gets a zero gradient, so
        DeepSpeed's collectives (ZeRO-3's parameter gathers, the gradient reductions) pair up with the other
        ranks' passes at the cost of two tokens."""
        out = self.forward(self.model, self._idle_row(), with_entropy=False)
        self.engine.backward(torch.stack([lp.sum() for lp in out.logprobs]).sum() * 0.0, last)

    def gathered(self, local: dict[int, Tensor], batch: TrainBatch) -> Tensor:
        """``[B, T]`` (0 off the mask) from each rank's ``{batch index: per-token values}`` of its rows."""
        parts = self.dp.gather({b: v.detach().float().cpu() for b, v in local.items()}) if self.dp.enabled else [local]
        out = torch.zeros(batch.size, batch.mask.shape[1])
        for part in parts:
            for b, v in part.items():
                out[b, : batch.lengths[b]] = v.detach().float().cpu()
        return out * batch.mask

    @torch.no_grad()
    def logprobs_of(self, model: nn.Module, batch: TrainBatch) -> Tensor:
        """``[B, T]`` log-probs of the response tokens under ``model`` (no gradient); rows split over the ranks."""
        local: dict[int, Tensor] = {}
        was_training = model.training
        model.eval()
        try:
            for entry in self.my_rows(self.pack(batch, range(batch.size))):
                if entry is None:
                    if model is self.model:  # ZeRO-3 gathers the policy's parameters in every rank's forward
                        self.forward(model, self._idle_row(), with_entropy=False)
                    continue
                row, idx = entry
                local.update(zip(idx, self.forward(model, row, with_entropy=False).logprobs, strict=True))
        finally:
            model.train(was_training)
        return self.gathered(local, batch)

    @torch.no_grad()
    def values_of(self, batch: TrainBatch) -> Tensor:
        """``[B, T]`` critic values ``V(s_t)`` of the response tokens; rows split over the ranks."""
        assert self.critic is not None
        local: dict[int, Tensor] = {}
        for entry in self.my_rows(self.pack(batch, range(batch.size))):
            if entry is not None:  # the critic is a plain module: no collective to pair up
                row, idx = entry
                local.update(zip(idx, self.critic.values(row, self.autocast_dtype), strict=True))
        return self.gathered(local, batch)

    # -- saving ----------------------------------------------------------------------------------

    def save_hf(self, folder: Path) -> None:
        """The policy's HF folder (and tokenizer); every rank calls it, rank 0 writes."""
        save = getattr(self.engine, "save_hf_model", None)
        if save is not None:
            save(folder)  # gathers ZeRO-3's partitions (a collective), writes on rank 0
        else:
            save_pretrained = getattr(self.model, "save_pretrained", None)
            if save_pretrained is None:
                raise TypeError("the policy cannot save_pretrained")
            save_pretrained(str(folder))
        if not self.dp.is_main:
            return
        source = Path(self.config.tokenizer) if self.config.tokenizer else self.model_folder
        if source is not None and (source / "tokenizer.json").is_file():
            for name in _TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, folder / name)
        elif self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(str(folder))
