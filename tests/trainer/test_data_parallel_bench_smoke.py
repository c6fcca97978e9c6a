"""benchmarks/data_parallel_bench.py runs end to end: one rank, then two, with the tiny model."""

from __future__ import annotations

import re

import pytest
from trainer_helpers import load_benchmark


@pytest.mark.slow
def test_data_parallel_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("data_parallel_bench.py")
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "1 rank(s):" in out and "2 rank(s):" in out and "speed-up" in out
    # ZeRO-2 partitions the optimizer state: each of two ranks holds half of what one rank holds.
    shares = [float(x) for x in re.findall(r"\((\d+\.\d+)x one rank's\)", out)]
    assert shares == [1.0, 0.5, 0.5]
