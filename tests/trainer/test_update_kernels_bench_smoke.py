"""benchmarks/update_kernels_bench.py runs end to end at a small size (the figures are measured by hand)."""

from __future__ import annotations

import re

import pytest
from trainer_helpers import load_benchmark


def test_update_kernels_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("update_kernels_bench.py")
    argv = ["--rows", "2", "--min-tokens", "100", "--max-tokens", "200", "--steps", "2", "--rounds", "1"]
    assert bench.main([*argv, "--scored", "16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.search(r"exact length (\d+) ms, padded to a multiple of 64 (\d+) ms -> ([\d.]+)x", out)
    steps = re.search(r"exact lengths ([\d.]+) s, padded to 64 ([\d.]+) s -> ([\d.]+)x", out)
    entropy = re.search(r"\(before\) ([\d.]+) ms, .* \(now\) ([\d.]+) ms -> ([\d.]+)x; .* up to ([\d.]+) nats", out)
    assert rows is not None and steps is not None and entropy is not None, out
    assert float(steps[1]) > 0 and float(steps[2]) > 0
    assert float(entropy[4]) > 0  # the bf16 dot product is not the float32 one: what the trainer no longer does


def test_update_kernels_bench_refuses_bad_options() -> None:
    bench = load_benchmark("update_kernels_bench.py")
    for argv in (["--rows", "0"], ["--min-tokens", "300", "--max-tokens", "200"], ["--steps", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2
