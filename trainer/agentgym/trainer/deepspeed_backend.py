"""DeepSpeed backend (GPUs): ZeRO-2/3, bf16, gradient checkpointing; multi-GPU via the DeepSpeed launcher.

``deepspeed`` is imported only when the backend is used: it is not a dependency of the runtime
install (the dev install pins it next to the CPU torch, which it then leaves alone). What is here:

* :func:`deepspeed_config`: the engine config dict. One micro-batch is one packed row (batch size
  1, no padding); the trainer weights each row's loss itself and marks the gradient-accumulation
  boundary explicitly at the last row of a mini-batch, so ``gradient_accumulation_steps`` is 1 and
  the loss is never rescaled by DeepSpeed. ZeRO-3 gathers 16-bit weights on save so checkpoints stay
  plain HF folders.
* :func:`launcher_command`: the ``deepspeed`` launcher command for ``gpus`` GPUs on one node (or a
  hostfile for several).
* :class:`DeepSpeedEngine`: the :class:`~agentgym.trainer.backend.PolicyEngine` used by
  ``RLTrainer`` when ``backend == "deepspeed"``.

Several GPUs train data-parallel, one rank each (``agentgym.trainer.distributed``: rank 0 collects
and announces each call, each rank trains on its share of the packed rows).

The tests train with this engine on DeepSpeed's CPU accelerator (gloo), on one rank and on two:
ZeRO-2 and ZeRO-3 in fp32 give the torch backend's update, bf16 with activation checkpointing trains,
and each resumes exactly from its checkpoints. CUDA, NCCL and FusedAdam are NOT exercised there.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from agentgym.trainer.backend import OptimizerSettings
from agentgym.trainer.config import RLTrainerConfig

__all__ = [
    "DeepSpeedEngine",
    "deepspeed_available",
    "deepspeed_config",
    "launcher_command",
    "skip_cpu_shared_memory_op",
]


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def skip_cpu_shared_memory_op() -> None:
    """On DeepSpeed's CPU accelerator, do not build its shared-memory all-reduce (call before it sets up
    ``torch.distributed``): it serves only DeepSpeed's inference kernels, and building it compiles C++
    for about a minute. Training's collectives go through the process group (gloo)."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(
    config: RLTrainerConfig,
    settings: OptimizerSettings | None = None,
    *,
    torch_adam: bool = False,
    world_size: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config dict for ``config`` (ZeRO stage, bf16, optimizer, clipping).

    ``world_size``: the data-parallel ranks (default ``config.gpus``), one packed row each per micro-step.

    ``torch_adam``: step with ``torch.optim.AdamW`` rather than DeepSpeed's FusedAdam, whose kernel
    is compiled on first use; for DeepSpeed's CPU accelerator, where there is nothing to fuse for.
    """
    settings = settings or OptimizerSettings(
        config.learning_rate, config.adam_betas, config.adam_eps, config.weight_decay, config.max_grad_norm
    )
    stage = int(config.zero_stage)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {stage}")
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
    }
    if stage == 2:
        zero.update(allgather_partitions=True, allgather_bucket_size=5e8, reduce_scatter=True)
    if stage == 3:
        zero.update(
            stage3_gather_16bit_weights_on_model_save=True,
            stage3_prefetch_bucket_size=5e8,
            stage3_param_persistence_threshold=1e6,
            stage3_max_live_parameters=1e9,
            stage3_max_reuse_distance=1e9,
        )
    world = max(1, int(config.gpus if world_size is None else world_size))
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": settings.max_grad_norm,
        "bf16": {"enabled": bool(config.bf16)},
        "fp16": {"enabled": config.dtype == "float16" and not config.bf16},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": settings.lr,
                "betas": list(settings.betas),
                "eps": settings.eps,
                "weight_decay": settings.weight_decay,
                **({"torch_adam": True} if torch_adam else {}),
            },
        },
        "activation_checkpointing": {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
        }
        if config.gradient_checkpointing
        else {},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def launcher_command(
    config_path: str | Path,
    gpus: int,
    *,
    run_yaml: str | Path | None = None,
    hostfile: str | Path | None = None,
    master_port: int = 29500,
    extra_args: list[str] | None = None,
) -> list[str]:
    """``deepspeed`` launcher argv running the trainer on ``gpus`` GPUs per node.

    ``config_path`` is the trainer's JSON config (``RLTrainerConfig.to_dict()``) or, with
    ``run_yaml``, the TrainingRun file; the module entry point is ``agentgym.trainer.entrypoint``.
    """
    if gpus < 1:
        raise ValueError("the DeepSpeed launcher needs gpus >= 1")
    argv = ["deepspeed"]
    if hostfile is not None:
        argv += ["--hostfile", str(hostfile)]
    else:
        argv += ["--num_gpus", str(gpus)]
    argv += ["--master_port", str(master_port), "--module", "agentgym.trainer.entrypoint"]
    if run_yaml is not None:
        argv += ["--run", str(run_yaml)]
    else:
        argv += ["--config", str(config_path)]
    argv += list(extra_args or [])
    return argv


def launcher_command_line(*args: Any, **kwargs: Any) -> str:
    return shlex.join(launcher_command(*args, **kwargs))


class DeepSpeedEngine:
    """``PolicyEngine`` over a DeepSpeed engine (ZeRO-2/3)."""

    def __init__(
        self, module: nn.Module, settings: OptimizerSettings, config: RLTrainerConfig, *, world_size: int = 1
    ) -> None:
        try:
            import deepspeed
        except ImportError as error:
            raise RuntimeError(
                "backend 'deepspeed' needs the deepspeed package (GPU images); use backend 'torch' on CPU"
            ) from error
        self.settings = settings
        skip_cpu_shared_memory_op()
        self.config_dict = deepspeed_config(
            config, settings, torch_adam=not torch.cuda.is_available(), world_size=world_size
        )
        engine, optimizer, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            config=self.config_dict,
        )
        self.ds = engine
        self.optimizer = optimizer
        self.module = engine.module
        self.zero_stage = int(config.zero_stage)

    def backward(self, loss: Tensor, last: bool) -> None:
        # The trainer's forward calls the module, not the engine, so the engine's start-of-forward bookkeeping
        # is made here. ZeRO-3 counts micro-steps in it: without it each packed row's gradient replaced the
        # previous rows' instead of adding to them.
        new_micro_step = getattr(self.optimizer, "clear_backward_seen_flag", None)
        if new_micro_step is not None:
            new_micro_step()
        self.ds.set_gradient_accumulation_boundary(last)
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.ds.set_gradient_accumulation_boundary(True)
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def optimizer_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.optimizer.state_dict()
        return state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def reset_optimizer_state(self) -> None:
        # ZeRO wraps a torch-style optimizer over its fp32 partitions; its state is created lazily on the next step.
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        inner.state.clear()

    def save_engine_state(self, folder: Path) -> None:
        """Optimizer (partitioned under ZeRO) and engine state, in DeepSpeed's own layout."""
        self.ds.save_checkpoint(str(folder), tag="engine", save_latest=False)

    def load_engine_state(self, folder: Path) -> None:
        self.ds.load_checkpoint(
            str(folder),
            tag="engine",
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )

    def save_hf_model(self, folder: Path) -> None:
        """Save the full (gathered under ZeRO-3) 16-bit weights as an HF folder, on rank 0."""
        import torch.distributed as dist

        state = self.ds._zero3_consolidated_16bit_state_dict() if self.zero_stage == 3 else self.module.state_dict()
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.module.save_pretrained(str(folder), state_dict=state)

    def load_hf_model(self, folder: Path) -> None:
        from agentgym.trainer.checkpoint import load_hf_weights

        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0):
                load_hf_weights(self.module, folder)
        else:
            load_hf_weights(self.module, folder)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
