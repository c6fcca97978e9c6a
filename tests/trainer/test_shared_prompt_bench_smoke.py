"""benchmarks/shared_prompt_bench.py runs end to end on a small batch (the figures are measured by hand)."""

from __future__ import annotations

import re

import pytest
from trainer_helpers import load_benchmark


def test_shared_prompt_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("shared_prompt_bench.py")
    argv = ["--groups", "2", "--group-size", "2", "--mini-batch", "4", "--repeats", "1", "--common-prefix", "300"]
    assert bench.main([*argv, "--no-bf16"]) == 0
    out = capsys.readouterr().out
    forwarded = {}
    for label in ("a prompt copy per sample", "a copy per group's prompt", "and of the common prefix"):
        found = re.search(rf"{label}: update ([\d.]+) s .*, (\d+) tokens forwarded", out)
        assert found is not None, out
        assert float(found[1]) > 0
        forwarded[label] = int(found[2])
    # each group's prompt once, then the 300 tokens both prompts start with once
    copies, per_group, prefix = forwarded.values()
    assert copies > per_group and per_group - prefix == 300
    gap = re.search(r"agree within ([\d.e+-]+) ", out)
    assert gap is not None and float(gap[1]) < 1e-3  # the same update, summed in another order


def test_batch_shares_one_prompt_per_group() -> None:
    bench = load_benchmark("shared_prompt_bench.py")
    batch = bench.babyai_shaped_batch(3, 4, 1000, 0)
    assert len(batch) == 12
    prompts = {t.group_id: list(t.prompt_token_ids) for t in batch}
    assert all(list(t.prompt_token_ids) == prompts[t.group_id] for t in batch) and len(prompts) == 3
    assert all(len(t.loss_mask) == len(t.response_token_ids) == len(t.sampled_logprobs) for t in batch)


def test_batch_prompts_share_the_common_prefix() -> None:
    bench = load_benchmark("shared_prompt_bench.py")
    batch = bench.babyai_shaped_batch(3, 2, 1000, 0, common_prefix=100)
    prompts = [list(t.prompt_token_ids) for t in batch]
    assert all(p[:100] == prompts[0][:100] for p in prompts)
    assert len({tuple(p[100:]) for p in prompts}) == 3  # the groups' prompts differ after it
