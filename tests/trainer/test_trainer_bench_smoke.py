"""benchmarks/trainer_gpu_bench.py runs end to end on CPU with tiny shapes (the GPU run is separate)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_gpu_bench.py"


def test_bench_smoke_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("trainer_gpu_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["trainer_gpu_bench"] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--sequences", "4"]) == 0
    out = capsys.readouterr().out
    assert "NOT a GPU result" in out
    assert "naive" in out and "trainer" in out and "speedup trainer / naive" in out
    diff = float(out.split("max |diff| = ")[1].split()[0])
    assert diff < 1e-4
    # FLOP accounting: dense + attention + LM head on sampled tokens
    from transformers import Qwen2Config

    config = Qwen2Config(**bench.SHAPES["smoke"])
    batch = bench.synthetic_batch(bench.Profile(2, (3, 3), (1, 1), (2, 2), (1, 1)), 4096, 0)
    flops = bench.useful_flops(config, batch, 1000)
    assert flops == 6 * 1000 * 10 + 6 * 2 * 64 * (25 + 25) + 6 * 4096 * 64 * 4
