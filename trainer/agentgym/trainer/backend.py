"""Optimisation backends behind one small interface: plain PyTorch here, DeepSpeed on GPUs.

The trainer computes each micro-batch's loss already weighted for its share of the mini-batch,
calls ``backward`` once per micro-batch (one packed row), then ``step`` once per mini-batch, which
clips the global gradient norm, applies the optimiser and zeroes the gradients. ``step`` returns
the gradient norm before clipping.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor, nn

__all__ = ["OptimizerSettings", "PolicyEngine", "TorchEngine"]


class OptimizerSettings:
    def __init__(
        self,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
    ) -> None:
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm


class PolicyEngine(Protocol):
    module: nn.Module

    def backward(self, loss: Tensor, last: bool) -> None: ...

    def step(self) -> float: ...

    def set_lr(self, lr: float) -> None: ...

    def get_lr(self) -> float: ...

    def optimizer_state(self) -> dict[str, Any]: ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...

    def reset_optimizer_state(self) -> None: ...


class TorchEngine:
    """AdamW on one device (CPU, or one GPU) with global-norm gradient clipping."""

    def __init__(self, module: nn.Module, settings: OptimizerSettings) -> None:
        self.module = module
        self.settings = settings
        params = [p for p in module.parameters() if p.requires_grad]
        fused = bool(params) and params[0].is_cuda
        self.optimizer = torch.optim.AdamW(
            params,
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            fused=fused or None,
        )
        self._params = params

    def backward(self, loss: Tensor, last: bool) -> None:
        loss.backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self._params, self.settings.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def reset_optimizer_state(self) -> None:
        """Forget the moment estimates and step counts (the next step is a fresh AdamW's first); lr is kept."""
        self.optimizer.state.clear()
