"""Derived seeds: deterministic, never 0 (the proto's "unseeded"), and distinct for distinct parts."""

from __future__ import annotations

from agentgym.seeding import derive_seed


def test_deterministic_and_in_range() -> None:
    assert derive_seed("eval", 0, "GoToRedBall/s1", 1) == derive_seed("eval", 0, "GoToRedBall/s1", 1)
    seeds = [derive_seed("run", step, task, sample) for step in range(20) for task in range(8) for sample in range(8)]
    assert all(1 <= s <= 2**31 - 1 for s in seeds)
    assert len(set(seeds)) == len(seeds)  # 1,280 episodes, 1,280 streams


def test_parts_are_not_interchangeable() -> None:
    # Arithmetic seeds collide (base + task + sample); hashed ones do not.
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert derive_seed(7, "turn", 1) != derive_seed(8, "turn", 0)
    assert derive_seed("a/b") == derive_seed("a", "b")  # parts are joined by "/": pick labels without one
