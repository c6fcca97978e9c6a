"""benchmarks/cpu_bf16_bench.py runs on this CPU and prints its comparisons (figures: by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentgym.cpus import cpu_has_bf16_units

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_bf16_bench.py"


def test_cpu_bf16_bench_smoke() -> None:
    command = [sys.executable, str(BENCH), "--tokens", "32", "--repeats", "1", "--inference", "--sequences", "2"]
    command += ["--prompt-tokens", "16", "--new-tokens", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "bf16 / float32 time:" in result.stdout and "bf16 units:" in result.stdout
    if cpu_has_bf16_units():  # the engines and the decode attention are compared only where bf16 is not emulated
        assert "bf16 speed-up: prefill" in result.stdout and "packed bf16 matrices vs plain" in result.stdout
        assert "decode attention, 2 rows over 16 keys, one layer: bf16 kernel" in result.stdout
    else:
        assert "computes in float32 on this CPU" in result.stdout
