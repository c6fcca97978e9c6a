"""metrics.jsonl after a resume: one line per step, the lines of what was trained but not committed dropped."""

from __future__ import annotations

import json
from pathlib import Path

from agentgym.trainer.metrics import MetricsSink


def lines(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line != "not json"]


def test_a_resumed_trainer_keeps_one_line_per_step(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, "r", tensorboard=False, otel=False)
    for sft_step in range(3):  # a warm-up, checkpointed
        sink.write(0, {"sft/sft_step": float(sft_step)})
    for step in range(10):  # trained 0..9; the checkpoint is of step 8 (steps 0..7 done)
        sink.write(step, {"loss": float(step)})
    (tmp_path / "metrics.jsonl").open("a").write("not json\n")
    assert sink.forget_from(8, sft_committed=True) == 2
    for step in (8, 9):  # trained again after the resume
        sink.write(step, {"loss": 10.0 + step})
    records = lines(tmp_path / "metrics.jsonl")
    assert [r["sft/sft_step"] for r in records[:3]] == [0.0, 1.0, 2.0]
    assert [r["step"] for r in records[3:]] == list(range(10))
    assert [r["loss"] for r in records[-2:]] == [18.0, 19.0]
    assert "not json" in (tmp_path / "metrics.jsonl").read_text()  # a line it cannot read is left alone
    assert sink.forget_from(20, sft_committed=True) == 0
    sink.close()


def test_a_warm_up_killed_before_its_checkpoint_is_forgotten(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, "r", tensorboard=False, otel=False)
    for sft_step in range(2):  # killed mid-warm-up: nothing saved
        sink.write(0, {"sft/sft_step": float(sft_step)})
    assert sink.forget_from(0, sft_committed=False) == 2
    assert lines(tmp_path / "metrics.jsonl") == []
    sink.close()
