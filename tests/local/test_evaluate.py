"""`agentgym eval`: pass@k against hand-computed values, and the command end to end (real services)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym.inference.models import load_tokenizer, tiny_model_dir
from agentgym.local.evaluate import (
    EvalSettings,
    eval_task_ids,
    k_values,
    pass_at_k,
    play_split,
    success_standard_error,
    summarise,
)
from agentgym.messaging import free_port
from agentgym.rollout.tokens import ChatTokenizer

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]


def test_pass_at_k_hand_computed() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k failures: every k-subset holds a success
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_summary_of_two_tasks() -> None:
    successes = {"a": [True, False, False, False], "b": [True, True, False, False]}
    scores = {"a": [0.9, 0.0, 0.0, 0.0], "b": [0.8, 0.6, 0.0, 0.0]}
    summary = summarise(successes, scores, 4)
    assert summary["avg@4"] == summary["success"] == pytest.approx(3 / 8)
    assert summary["pass@k"]["1"] == pytest.approx((0.25 + 0.5) / 2)
    assert summary["pass@k"]["2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert summary["pass@k"]["4"] == 1.0
    assert summary["score_mean"] == pytest.approx(2.3 / 8)
    assert summary["task_success"] == {"a": 0.25, "b": 0.5}
    # Standard error over the task rates 0.25 and 0.5: sqrt(((0.125^2) * 2) / 1 / 2) = 0.125.
    assert success_standard_error(successes) == pytest.approx(0.125)
    # Spread over the 75 tasks of test-easy: indices 0, 25, 50 (index i is level i % 3, seed i // 3).
    assert eval_task_ids("babyai", "test-easy", 3, spread=True) == [
        "GoToRedBallGrey/s0",
        "GoToRedBall/s8",
        "GoToRedBallNoDists/s16",
    ]


@pytest.mark.slow
def test_eval_command_sweeps_max_turns_with_environment_settings(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    command = [*AGENTGYM, "eval", "builtin:tiny", "--env", "babyai", "--split", "test-easy", "--tasks", "3"]
    command += ["--samples", "2", "--max-turns", "1", "--max-turns", "2", "--max-tokens-per-turn", "8"]
    command += ["--top-p", "0.9", "--set", "list_actions=false", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["settings"]["env_settings"] == ["list_actions=false"]
    assert results["settings"]["top_p"] == 0.9
    assert set(results["by_max_turns"]) == {"1", "2"}
    for turns, summary in results["by_max_turns"].items():
        assert summary["tasks"] == 3 and summary["episodes"] == 6
        assert set(summary["pass@k"]) == {"1", "2"}
        assert 0.0 <= summary["avg@2"] <= 1.0
        assert summary["turns_mean"] <= int(turns)
    bad = subprocess.run([*command[:-4], "--set", "novalue"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--set expects KEY=VALUE" in bad.stderr
    no_nucleus = subprocess.run([*command[:-6], "--top-p", "0"], capture_output=True, text=True, timeout=120)
    assert no_nucleus.returncode == 2 and "--top-p must be in (0, 1], not 0.0" in no_nucleus.stderr


async def test_episodes_ended_by_errors_are_counted_with_their_reason() -> None:
    """Nothing listens where the environment service should be: every episode fails, and the summary says why
    (a bare error count once hid which part failed a recipe's evaluation)."""
    settings = EvalSettings(environment="babyai", split="test-easy", tasks=2, samples=2, max_turns=[2])
    nowhere = f"http://127.0.0.1:{free_port()}"
    chat = ChatTokenizer(load_tokenizer(tiny_model_dir()))
    summary = (await play_split(settings, nowhere, nowhere, chat))["by_max_turns"]["2"]
    assert summary["episodes"] == 4 and summary["errors"] == 4 and summary["success"] == 0.0
    [(reason, count)] = summary["error_reasons"].items()
    assert count == 4 and "127.0.0.1" in reason and len(reason) <= 200, reason
