"""BabyAIExpert: the bot's demonstrations, replayed on a fresh environment, solve the tasks."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from agentgym.envs import UnknownTaskError
from agentgym.envs.babyai.env import BabyAIEnv
from agentgym.envs.babyai.expert import BabyAIExpert, BabyAIExpertError
from agentgym.envs.babyai.levels import LEVELS

MACRO = re.compile(
    r"^(turn left|turn right|move forward|drop|(pick up|toggle|go to) (red|green|blue|purple|yellow|grey) \w+ \d+)$"
)


def replay_success_rate(task_ids: list[str]) -> tuple[float, Counter[str]]:
    """Fraction of tasks whose expert demonstration, replayed on a fresh env, succeeds; and the
    failures per level."""
    expert, env = BabyAIExpert(), BabyAIEnv()
    failures: Counter[str] = Counter()
    for task_id in task_ids:
        try:
            actions = expert.demonstrate(task_id)
        except BabyAIExpertError:
            failures[task_id.split("/")[0]] += 1
            continue
        env.reset(task_id)
        result = None
        for action in actions:
            assert MACRO.match(action), action
            result = env.step(action)
            assert not result.info["invalid_action"], (task_id, action, result.observation)
        if result is None or not (result.done and result.info["success"]):
            failures[task_id.split("/")[0]] += 1
    return 1 - sum(failures.values()) / len(task_ids), failures


def test_demonstration_replays_to_success() -> None:
    task_id = "BossLevel/s0"
    actions = BabyAIExpert().demonstrate(task_id)
    assert actions and all(MACRO.match(a) for a in actions)
    assert actions == BabyAIExpert().demonstrate(task_id)  # deterministic
    env = BabyAIEnv()
    env.reset(task_id)
    results = [env.step(action) for action in actions]
    assert all(not r.done for r in results[:-1])
    assert results[-1].done and results[-1].info["success"] and results[-1].reward > 0
    assert results[-1].score == pytest.approx(results[-1].reward)


def test_expert_rejects_unknown_tasks() -> None:
    with pytest.raises(UnknownTaskError):
        BabyAIExpert().demonstrate("NoSuchLevel/s0")


def test_expert_reports_a_stuck_bot() -> None:
    # On this layout minigrid's BabyAIBot replans forever; the expert must give up, not hang.
    with pytest.raises(BabyAIExpertError, match="stuck"):
        BabyAIExpert().demonstrate("GoToImpUnlock/s6")


def test_expert_fast_sample_all_levels() -> None:
    """One test task per level (40 tasks)."""
    task_ids = [f"{level}/s1" for level in LEVELS]
    rate, failures = replay_success_rate(task_ids)
    print(f"expert replay success: {rate:.1%} of {len(task_ids)} test tasks; failures {dict(failures)}")
    assert rate >= 0.95


@pytest.mark.slow
def test_expert_test_split_sample() -> None:
    """The first 400 test tasks: 10 seeds of every level."""
    task_ids = list(BabyAIEnv.catalog().task_ids("test", limit=400))
    rate, failures = replay_success_rate(task_ids)
    print(f"expert replay success: {rate:.1%} of {len(task_ids)} test tasks; failures {dict(failures)}")
    assert rate >= 0.95


def test_goto_missions_use_the_go_to_macro() -> None:
    from agentgym.envs import make

    expert = BabyAIExpert()
    for task_id in ("GoToRedBall/s0", "GoToRedBallGrey/s3", "GoToRedBallNoDists/s1"):
        actions = expert.demonstrate(task_id)
        assert actions[-1].startswith("go to red ball ")
        step_by_step = BabyAIExpert(use_macros=False).demonstrate(task_id)
        assert len(actions) <= len(step_by_step)
        env = make("babyai")
        env.reset(task_id)
        for action in actions:
            result = env.step(action)
        assert result.done and result.info["success"]
