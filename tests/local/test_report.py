"""`agentgym report` of a run: the test-time scaling figures (the paper's Fig. 8 and 9) from the eval files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentgym.local.report import make_report


def sweep(successes: dict[int, float], passes: dict[int, float]) -> dict[str, Any]:
    last = max(successes)
    return {
        "by_max_turns": {
            str(turns): {"success": rate, "success_se": 0.05, "avg@8": rate, "pass@k": passes if turns == last else {}}
            for turns, rate in successes.items()
        }
    }


def test_base_and_trained_sweeps_are_overlaid_with_their_numbers(tmp_path: Path) -> None:
    row = {"step": 0, "horizon": 5, "policy_loss": 0.1, "env": {"all": {"success_rate": 0.1, "reward_mean": 0.1}}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "eval").mkdir()
    base = sweep({2: 0.05, 5: 0.10, 10: 0.12}, {"1": 0.12, "2": 0.2, "4": 0.3, "8": 0.41})
    trained = sweep({2: 0.30, 5: 0.55, 10: 0.60}, {"1": 0.6, "2": 0.7, "4": 0.78, "8": 0.85})
    (tmp_path / "eval" / "base.json").write_text(json.dumps(base))
    (tmp_path / "eval" / "trained.json").write_text(json.dumps(trained))
    # A run's own phase eval (one horizon, one sample) has no sweep: it is in neither figure.
    (tmp_path / "eval" / "end.json").write_text(json.dumps(sweep({5: 0.5}, {"1": 0.5})))
    result = make_report(tmp_path)
    names = {Path(p).name for p in result["figures"]}
    assert {"test_time_max_turns.png", "test_time_pass_at_k.png"} <= names
    text = result["text"]
    assert "success by max turns (base): 2: 0.05, 5: 0.10, 10: 0.12" in text
    assert "success by max turns (trained): 2: 0.30, 5: 0.55, 10: 0.60" in text
    assert "pass@k at 10 turns (trained): 1: 0.60, 2: 0.70, 4: 0.78, 8: 0.85" in text
    assert "(end)" not in text
    assert (tmp_path / "report" / "test_time_pass_at_k.png").stat().st_size > 10_000
