"""benchmarks/cascade_attention_bench.py runs, prints a line per case, and both attentions agree (figures: by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cascade_attention_bench.py"


def test_cascade_attention_bench_smoke() -> None:
    command = [sys.executable, str(BENCH), "--tasks", "2", "--samples", "3", "--prefix", "64", "--own", "8,24"]
    command += ["--layers", "2", "--repeats", "1", "--flush-mb", "1", "--kv-heads", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["8"], ["24"])]
    assert [(row[0], row[1]) for row in rows] == [("8", "1"), ("8", "1+helper"), ("24", "1"), ("24", "1+helper")]
    assert all(float(row[5]) < 1e-5 for row in rows)  # the largest difference of the two attentions' outputs
