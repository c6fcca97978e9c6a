"""benchmarks/mini_batch_grouping_bench.py runs end to end on a small batch (the figures are measured by hand)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "mini_batch_grouping_bench.py"


def test_mini_batch_grouping_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("mini_batch_grouping_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["mini_batch_grouping_bench"] = bench
    spec.loader.exec_module(bench)
    argv = ["--groups", "2", "--group-size", "2", "--mini-batch", "2", "--repeats", "1", "--no-bf16"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    shuffled = re.search(r"shuffled across groups: update ([\d.]+) s .*, (\d+) tokens forwarded", out)
    grouped = re.search(r"whole groups: update ([\d.]+) s .*, (\d+) tokens forwarded", out)
    assert shuffled is not None and grouped is not None, out
    assert float(shuffled[1]) > 0 and float(grouped[1]) > 0
    assert int(grouped[2]) <= int(shuffled[2])  # a whole group per mini-batch: its prompt once
    assert re.search(r"speed-up: [\d.]+x; tokens forwarded: [\d.]+ of the shuffled", out)


def test_mini_batch_grouping_bench_refuses_empty_settings() -> None:
    spec = importlib.util.spec_from_file_location("mini_batch_grouping_bench_args", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as exited:
        bench.main(["--mini-batch", "0"])
    assert exited.value.code == 2
