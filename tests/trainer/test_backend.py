"""The CPU/GPU torch backend's optimiser: fused AdamW, the same update as torch's default one."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from agentgym.trainer import backend
from agentgym.trainer.backend import OptimizerSettings, TorchEngine, fused_adamw


def _train(optimizer_for: Any, steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = optimizer_for(list(module.parameters()))
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=generator)
        loss = module(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in module.parameters()]


def test_fused_adamw_on_cpu_makes_the_default_update() -> None:
    settings = OptimizerSettings(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    optimizer = fused_adamw([torch.nn.Parameter(torch.zeros(3))], settings)
    assert optimizer.defaults["fused"] is True
    assert optimizer.defaults["weight_decay"] == 0.1 and optimizer.defaults["betas"] == (0.8, 0.99)
    fused = _train(lambda params: fused_adamw(params, settings))
    default = _train(
        lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=False)
    )
    for a, b in zip(fused, default, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(fused, _train(lambda p: torch.optim.SGD(p, lr=0.0)), strict=True))


def test_fused_adamw_falls_back_where_torch_has_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.optim.AdamW

    def no_fused_kernel(params: Any, **kwargs: Any) -> torch.optim.AdamW:
        if kwargs.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(params, **kwargs)

    monkeypatch.setattr(backend.torch.optim, "AdamW", no_fused_kernel)
    optimizer = fused_adamw([torch.nn.Parameter(torch.zeros(3))], OptimizerSettings(lr=1e-3))
    assert not optimizer.defaults.get("fused")


def test_torch_engine_uses_the_fused_optimiser() -> None:
    engine = TorchEngine(torch.nn.Linear(4, 2), OptimizerSettings(lr=1e-3))
    assert engine.optimizer.defaults["fused"] is True


def test_optimizer_bench_smoke(tiny_model: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "optimizer_bench.py"
    spec = importlib.util.spec_from_file_location("optimizer_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", str(tiny_model), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "fused kernel: True" in out
    gap = re.search(r"speed-up: [\d.]+x; largest weight difference after 3 steps: ([\d.e+-]+)", out)
    assert gap is not None, out
    assert float(gap[1]) < 1e-5
