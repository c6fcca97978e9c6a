"""benchmarks/trainer_thread_bench.py runs end to end on a small batch (the figures are measured by hand)."""

from __future__ import annotations

import re

import pytest
from trainer_helpers import load_benchmark


def test_trainer_thread_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("trainer_thread_bench.py")
    argv = ["--groups", "1", "--group-size", "2", "--mini-batch", "2", "--repeats", "2", "--no-bf16"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    rounds = re.findall(r"round (\d) (worker thread|main thread) +([\d.]+) s", out)
    # a warm-up round and two timed ones, each mode once a round, the first mode alternating
    assert [(r, mode) for r, mode, _ in rounds] == [
        ("0", "worker thread"),
        ("0", "main thread"),
        ("1", "main thread"),
        ("1", "worker thread"),
        ("2", "worker thread"),
        ("2", "main thread"),
    ]
    assert all(float(seconds) > 0 for *_, seconds in rounds)
    medians = re.findall(r"(worker|main) thread \((?:before|now)\): +([\d.]+) s a step, median of 2", out)
    assert [name for name, _ in medians] == ["worker", "main"], out
    ratio = re.search(r"main thread vs worker thread: ([\d.]+)x", out)
    assert ratio is not None and float(ratio[1]) > 0


def test_trainer_thread_bench_refuses_a_zero_count() -> None:
    bench = load_benchmark("trainer_thread_bench.py")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--repeats", "0"])
    assert exit_.value.code == 2
