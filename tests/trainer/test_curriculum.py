"""Horizon schedules: fixed, ScalingInter-RL stages, adaptive; state dicts and the factory."""

from __future__ import annotations

import json

import pytest

from agentgym.trainer.curriculum import (
    PAPER_SCALING_INTER,
    AdaptiveHorizon,
    CurriculumState,
    FixedHorizon,
    HorizonSchedule,
    ScalingInterSchedule,
    build_schedule,
    paper_preset,
)


def run(schedule: HorizonSchedule, metrics: list[tuple[float, float]], start: int = 0) -> list[int]:
    """Horizons returned by update(step) for consecutive steps, metrics (success, truncation)."""
    return [schedule.update(start + i, {"success_rate": s, "truncation_rate": u}) for i, (s, u) in enumerate(metrics)]


# ---------------------------------------------------------------------------------------------
# fixed and ScalingInter
# ---------------------------------------------------------------------------------------------


def test_fixed_horizon() -> None:
    s = FixedHorizon(7)
    assert s.horizon(0) == s.horizon(10**6) == s.current_horizon == 7
    assert s.update(0) == 7
    assert s.state() == CurriculumState(step=1, stage=0, horizon=7, schedule="fixed", metrics={})
    with pytest.raises(ValueError):
        FixedHorizon(0)


def test_scaling_inter_boundaries_exactly_at_stage_steps() -> None:
    s = ScalingInterSchedule([6, 13, 20], stage_steps=100)
    assert [s.horizon(t) for t in (0, 99, 100, 199, 200, 10**5)] == [6, 6, 13, 13, 20, 20]
    assert [s.stage_at(t) for t in (0, 99, 100, 199, 200)] == [0, 0, 1, 1, 2]
    # driven step by step: the horizon each step's rollouts use
    used = []
    for step in range(251):
        used.append(s.current_horizon)
        s.update(step, {"success_rate": 0.5})
    assert used == [6] * 100 + [13] * 100 + [20] * 51
    assert s.state().to_dict() == {
        "step": 251,
        "stage": 2,
        "horizon": 20,
        "schedule": "scaling_inter",
        "metrics": {"success_rate": 0.5},
    }


def test_scaling_inter_update_returns_next_steps_horizon() -> None:
    s = ScalingInterSchedule([6, 13, 20], stage_steps=100)
    assert run(s, [(0.0, 0.0)] * 99) == [6] * 99  # after steps 0..98: steps 1..99 still stage 0
    assert s.update(99) == 13  # step 100 is the first of stage 1
    assert (s.step, s.stage, s.current_horizon) == (100, 1, 13)


def test_scaling_inter_explicit_boundaries() -> None:
    s = ScalingInterSchedule([6, 13, 20], boundaries=[10, 25])
    assert [s.horizon(t) for t in (0, 9, 10, 24, 25, 1000)] == [6, 6, 13, 13, 20, 20]
    with pytest.raises(ValueError, match="not both"):
        ScalingInterSchedule([6, 13], stage_steps=10, boundaries=[10])
    with pytest.raises(ValueError, match="boundaries"):
        ScalingInterSchedule([6, 13, 20], boundaries=[10])
    with pytest.raises(ValueError, match="increase strictly"):
        ScalingInterSchedule([6, 13, 20], boundaries=[10, 10])


def test_paper_presets() -> None:
    assert {k: (v.horizons, v.stage_steps) for k, v in PAPER_SCALING_INTER.items()} == {
        "babyai": ((6, 13, 20), 100),
        "textcraft": ((10, 20, 30), 100),
        "sciworld": ((10, 20, 30), 100),
        "deepsearch": ((5, 8, 10), 100),
        "webarena": ((8, 12, 15), 80),
    }
    assert paper_preset("Deep Search") == paper_preset("deep_search") == PAPER_SCALING_INTER["deepsearch"]
    web = ScalingInterSchedule.paper_default("webarena")
    assert [web.horizon(t) for t in (0, 79, 80, 159, 160)] == [8, 8, 12, 12, 15]
    with pytest.raises(ValueError, match="preset"):
        paper_preset("chess")


def test_update_never_goes_back() -> None:
    s = ScalingInterSchedule([6, 13], stage_steps=10)
    s.update(0)
    with pytest.raises(ValueError, match="step"):
        s.update(0)
    s.update(5)  # skipping ahead is allowed
    assert s.step == 6


def test_scaling_inter_state_dict_round_trip() -> None:
    a = ScalingInterSchedule([6, 13, 20], stage_steps=100)
    run(a, [(0.1, 0.2)] * 150)
    b = ScalingInterSchedule([6, 13, 20], stage_steps=100)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.step, b.stage, b.current_horizon) == (150, 1, 13)
    assert b.state() == a.state()
    with pytest.raises(ValueError, match="schedule"):
        FixedHorizon(3).load_state_dict(a.state_dict())


# ---------------------------------------------------------------------------------------------
# adaptive
# ---------------------------------------------------------------------------------------------


def test_adaptive_raises_only_after_patience_and_needs_both_conditions() -> None:
    # window 1: plateau = S[-1] - S[-2] < 0.05; truncated = U[-1] > 0.5; patience 3; no cooldown
    s = AdaptiveHorizon(
        initial=5, minimum=5, maximum=20, increment=5, window=1, plateau_delta=0.05,
        truncation_threshold=0.5, patience=3, cooldown=0,
    )  # fmt: skip
    metrics = [
        (0.1, 0.9),  # step 0: one point, no plateau yet         streak 0
        (0.1, 0.9),  # step 1: plateau, truncated                streak 1
        (0.1, 0.9),  # step 2:                                   streak 2
        (0.3, 0.9),  # step 3: improved by 0.2 -> no plateau      streak 0
        (0.3, 0.9),  # step 4:                                   streak 1
        (0.3, 0.2),  # step 5: plateau but not truncated         streak 0
        (0.3, 0.9),  # step 6:                                   streak 1
        (0.3, 0.9),  # step 7:                                   streak 2
        (0.3, 0.9),  # step 8:                                   streak 3 -> raise to 10
    ]
    assert run(s, metrics) == [5] * 8 + [10]
    assert s.state() == CurriculumState(
        step=9, stage=1, horizon=10, schedule="adaptive", metrics={"success_rate": 0.3, "truncation_rate": 0.9}
    )


def test_adaptive_window_compares_two_window_means() -> None:
    # window 2: needs 4 points at the current horizon; plateau = mean(S[-2:]) - mean(S[-4:-2]) < 0.05
    s = AdaptiveHorizon(
        initial=4, minimum=2, maximum=10, increment=3, window=2, plateau_delta=0.05,
        truncation_threshold=0.5, patience=1, cooldown=0,
    )  # fmt: skip
    # steps 0-3: S = .1 .2 .3 .4: (.35 - .15) = .2 -> no plateau at step 3
    # step 4: S[-4:] = .2 .3 .4 .42: (.41 - .25) = .16 -> no
    # step 5: .3 .4 .42 .42: (.42 - .35) = .07 -> no
    # step 6: .4 .42 .42 .42: (.42 - .41) = .01 -> plateau, trunc mean .8 > .5 -> raise to 7
    metrics = [(0.1, 0.8), (0.2, 0.8), (0.3, 0.8), (0.4, 0.8), (0.42, 0.8), (0.42, 0.8), (0.42, 0.8)]
    assert run(s, metrics) == [4, 4, 4, 4, 4, 4, 7]


def test_adaptive_respects_cooldown() -> None:
    # window 1, patience 1, cooldown 3, condition always true once two points exist:
    #   step 0: 1 point -> no;  step 1: raise 2 -> 3 (first change, nothing to cool down from)
    #   step 2: history was reset, 1 point -> no
    #   step 3: condition holds but 3 - 1 = 2 < 3 -> blocked
    #   step 4: 4 - 1 = 3 >= 3 -> raise to 4
    #   step 5: 1 point; step 6: 6 - 4 = 2 blocked; step 7: raise to 5
    s = AdaptiveHorizon(
        initial=2, minimum=1, maximum=100, increment=1, window=1, plateau_delta=0.05,
        truncation_threshold=0.5, patience=1, cooldown=3,
    )  # fmt: skip
    assert run(s, [(0.2, 0.9)] * 8) == [2, 3, 3, 3, 4, 4, 4, 5]
    assert s.stage == 3


def test_adaptive_cooldown_with_window_two() -> None:
    # window 2, patience 2, cooldown 8, constant plateau (S = .3, U = .8):
    #   steps 0-2: < 4 points; step 3: streak 1; step 4: streak 2 -> raise 4 -> 7 (change at 4)
    #   steps 5-7: < 4 points; step 8: streak 1; steps 9-11: streak 2-4 but blocked (s - 4 < 8)
    #   step 12: 12 - 4 = 8 -> raise 7 -> 10 (= maximum), then it stays
    s = AdaptiveHorizon(
        initial=4, minimum=2, maximum=10, increment=3, window=2, plateau_delta=0.05,
        truncation_threshold=0.5, patience=2, cooldown=8,
    )  # fmt: skip
    assert run(s, [(0.3, 0.8)] * 20) == [4] * 4 + [7] * 8 + [10] * 8


def test_adaptive_bounds_and_decrease() -> None:
    # increment past the maximum is clamped
    up = AdaptiveHorizon(
        initial=8, minimum=2, maximum=10, increment=5, window=1, plateau_delta=0.05,
        truncation_threshold=0.5, patience=1, cooldown=0,
    )  # fmt: skip
    assert run(up, [(0.2, 0.9)] * 6) == [8, 10, 10, 10, 10, 10]
    # decrease: mean truncation < 0.05 and mean success >= 0.9 over the window, down to the minimum
    kwargs = dict(
        initial=6, minimum=3, maximum=10, increment=2, window=1, plateau_delta=0.05,
        truncation_threshold=0.5, patience=1, cooldown=0, low_truncation_threshold=0.05,
        high_success_threshold=0.9,
    )  # fmt: skip
    down = AdaptiveHorizon(allow_decrease=True, **kwargs)  # type: ignore[arg-type]
    # step 0: 6 -> 4; step 1: 4 -> max(2, 3) = 3; then at the minimum
    assert run(down, [(0.95, 0.0)] * 4) == [4, 3, 3, 3]
    # not below the success bar, or truncated: no decrease
    assert run(AdaptiveHorizon(allow_decrease=True, **kwargs), [(0.85, 0.0), (0.95, 0.1)]) == [6, 6]  # type: ignore[arg-type]
    # decreasing is off by default
    assert run(AdaptiveHorizon(**kwargs), [(0.95, 0.0)] * 4) == [6] * 4  # type: ignore[arg-type]


def test_adaptive_validation() -> None:
    with pytest.raises(ValueError, match="minimum <= initial <= maximum"):
        AdaptiveHorizon(initial=12, minimum=2, maximum=10)
    with pytest.raises(ValueError, match="low_truncation_threshold"):
        AdaptiveHorizon(initial=5, minimum=2, maximum=10, truncation_threshold=0.3, low_truncation_threshold=0.4)
    s = AdaptiveHorizon(initial=5, minimum=2, maximum=10)
    with pytest.raises(ValueError, match="truncation_rate"):
        s.update(0, {"success_rate": 0.5})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        s.update(0, {"success_rate": 1.5, "truncation_rate": 0.0})
    assert s.state_dict()["success_history"] == []  # a refused update leaves no trace
    assert s.step == 0


def _metrics_sequence(n: int) -> list[tuple[float, float]]:
    # deterministic, with stretches of plateau + truncation (raises) and of progress
    out = []
    for i in range(n):
        success = round(0.1 + 0.05 * ((i // 7) % 3) + 0.01 * (i % 2), 4)
        truncation = 0.9 if (i // 5) % 4 != 3 else 0.1
        out.append((success, truncation))
    return out


def test_adaptive_state_dict_round_trip_mid_run_gives_identical_future() -> None:
    config = dict(
        initial=3, minimum=2, maximum=40, increment=2, window=2, plateau_delta=0.04,
        truncation_threshold=0.5, patience=2, cooldown=4,
    )  # fmt: skip
    metrics = _metrics_sequence(60)
    uninterrupted = AdaptiveHorizon(**config)  # type: ignore[arg-type]
    expected = run(uninterrupted, metrics)

    first = AdaptiveHorizon(**config)  # type: ignore[arg-type]
    before = run(first, metrics[:27])
    saved = json.loads(json.dumps(first.state_dict()))
    # the snapshot is mid-run: changes already happened, a full history and a streak are in flight
    assert saved["stage"] >= 1 and len(saved["success_history"]) == 4 and saved["raise_streak"] == 1
    resumed = AdaptiveHorizon(**config)  # type: ignore[arg-type]
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == first.state_dict()
    after = run(resumed, metrics[27:], start=resumed.step)
    assert before + after == expected
    assert len(set(after)) > 1  # the horizon still changes after the resume
    assert resumed.state_dict() == uninterrupted.state_dict()
    # a fresh schedule fed only the remaining steps does not reproduce it (the state matters)
    assert run(AdaptiveHorizon(**config), metrics[27:], start=27) != after  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# factory and published state
# ---------------------------------------------------------------------------------------------


def test_build_schedule() -> None:
    fixed = build_schedule("fixed", max_turns=5)
    assert isinstance(fixed, FixedHorizon) and fixed.current_horizon == 5
    si = build_schedule("scaling-inter", horizons=[2, 4], stage_steps=3)
    assert isinstance(si, ScalingInterSchedule) and [si.horizon(t) for t in range(5)] == [2, 2, 2, 4, 4]
    paper = build_schedule("scaling_inter", environment="WebArena")
    assert isinstance(paper, ScalingInterSchedule) and paper.boundaries == [80, 160]
    custom = build_schedule("scaling_inter", environment="babyai", stage_steps=50)
    assert isinstance(custom, ScalingInterSchedule)
    assert (custom.horizons, custom.boundaries) == ([6, 13, 20], [50, 100])
    bounded = build_schedule("scaling_inter", environment="babyai", boundaries=[10, 30])
    assert isinstance(bounded, ScalingInterSchedule) and bounded.boundaries == [10, 30]
    adaptive = build_schedule("adaptive", initial=4, minimum=2, maximum=8)
    assert isinstance(adaptive, AdaptiveHorizon) and adaptive.current_horizon == 4
    with pytest.raises(ValueError, match="unknown horizon schedule"):
        build_schedule("linear")


@pytest.mark.parametrize(
    ("kind", "params", "named"),
    [
        ("fixed", {"horizon": 5}, "horizon; it takes max_turns"),
        (
            "scaling_inter",
            {"horizons": [2, 4], "stage_step": 3},
            "stage_step; it takes boundaries, horizons, stage_steps",
        ),
        ("adaptive", {"initial": 4, "max": 8}, "max; it takes allow_decrease"),
    ],
)
def test_build_schedule_names_an_unknown_parameter(kind: str, params: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=f"horizon schedule '{kind}': unknown parameter\\(s\\) {named}"):
        build_schedule(kind, **params)


def test_curriculum_state_dict_round_trip() -> None:
    state = CurriculumState(step=3, stage=1, horizon=13, schedule="scaling_inter", metrics={"success_rate": 0.25})
    assert CurriculumState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
