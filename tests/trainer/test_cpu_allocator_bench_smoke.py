"""benchmarks/cpu_allocator_bench.py runs end to end at a small size (the figures are measured by hand)."""

from __future__ import annotations

import re

import pytest
from trainer_helpers import load_benchmark

SMALL = ["--rounds", "1", "--repeats", "1", "--head-tokens", "8", "--groups", "1", "--group-size", "2"]
SMALL += ["--mini-batch", "2", "--concurrency", "2", "--prompt-tokens", "16", "--max-tokens", "2"]


@pytest.mark.slow
def test_cpu_allocator_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("cpu_allocator_bench.py")
    assert bench.main(SMALL) == 0
    out = capsys.readouterr().out
    for label in ("glibc defaults", "retained"):
        row = re.search(rf"round 0, {label}: exp ([\d.]+) ms, update ([\d.]+) s, decode ([\d.]+) s", out)
        assert row is not None, out
        assert all(float(value) > 0 for value in row.groups())
    assert re.search(r"speed-up \(defaults / retained\): exp [\d.]+x, update [\d.]+x, decode [\d.]+x", out), out


def test_cpu_allocator_bench_rejects_bad_counts() -> None:
    bench = load_benchmark("cpu_allocator_bench.py")
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--prompt-tokens", "0"])
