"""benchmarks/sampler_bench.py runs and prints its top-p cases and the decode step's choice (figures: by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "sampler_bench.py"


def test_sampler_bench_smoke() -> None:
    command = [sys.executable, str(BENCH), "--rows", "2", "--vocabulary", "3000", "--repeats", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    for case in ("peaked (a warmed-up policy)", "less sure", "flat (a random model)"):
        assert f"{case}: nucleus of" in result.stdout
    assert result.stdout.count("the speed of the full sort") == 3
    assert "choose_tokens (now)" in result.stdout and "the speed of before" in result.stdout
