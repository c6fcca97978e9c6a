"""benchmarks/lm_head_bench.py runs end to end at a small size (the figures are measured by hand)."""

from __future__ import annotations

import re

import pytest
from trainer_helpers import load_benchmark


def test_lm_head_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("lm_head_bench.py")
    from agentgym.trainer import packing

    fusable = packing._fusable_head
    argv = ["--tokens", "4", "--memory-tokens", "64", "--groups", "1", "--group-size", "2", "--mini-batch", "2"]
    argv += ["--repeats", "1", "--no-bf16"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    head = re.search(r"head, +4 tokens .* fused +([\d.]+) ms, .* agree within ([\d.e+-]+)", out)
    assert head is not None, out
    assert float(head[2]) < 1e-4  # the same log-probs, entropies and gradients
    peak = re.search(r"peak memory, 64 tokens .*: log_softmax \+ gather (-?\d+) MB, fused (-?\d+) MB", out)
    assert peak is not None, out
    update = re.search(r"last grad norms ([\d.]+) / ([\d.]+)", out)
    assert update is not None, out
    assert float(update[1]) == pytest.approx(float(update[2]), rel=1e-4)
    assert packing._fusable_head is fusable  # the unfused setting is undone
