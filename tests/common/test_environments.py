"""The environment cards: the one place a kind of environment is described, and what derives from it."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import get_args

import pytest

from agentgym.environments import ENVIRONMENT_NAMES, ENVIRONMENTS, EnvironmentName, card
from agentgym.spec import PAPER_HORIZONS, PAPER_STAGE_STEPS, EnvironmentSpec

ROOT = Path(__file__).resolve().parents[2]


def test_the_literal_names_exactly_the_cards() -> None:
    assert get_args(EnvironmentName) == ENVIRONMENT_NAMES == tuple(ENVIRONMENTS)
    assert ENVIRONMENT_NAMES == ("babyai", "textcraft", "sciworld", "deepsearch", "webarena")


def test_every_card_is_a_spec_environment() -> None:
    for name in ENVIRONMENT_NAMES:
        assert EnvironmentSpec(name=name).name == name  # type: ignore[arg-type]


def test_the_spec_presets_are_the_cards() -> None:
    assert {name: list(c.horizons) for name, c in ENVIRONMENTS.items()} == PAPER_HORIZONS
    assert {name: c.stage_steps for name, c in ENVIRONMENTS.items()} == PAPER_STAGE_STEPS
    assert PAPER_HORIZONS["babyai"] == [6, 13, 20] and PAPER_STAGE_STEPS["webarena"] == 80


@pytest.mark.parametrize("name", ENVIRONMENT_NAMES)
def test_a_card_points_into_its_own_folder(name: str) -> None:
    c = card(name)
    assert c.name == name
    assert all(b > a for a, b in zip(c.horizons, c.horizons[1:], strict=False)) and c.stage_steps > 0
    assert c.score_scale > 0
    assert (ROOT / "services" / "envs" / "agentgym" / "envs" / name).is_dir()
    for entry in (c.environment_class, c.expert_class):
        module, _, attr = entry.partition(":")
        assert module.startswith(f"agentgym.envs.{name}.") and attr
        path = ROOT / "services" / "envs" / Path(*module.split(".")).with_suffix(".py")
        assert f"class {attr}" in path.read_text(encoding="utf-8")


def test_every_card_has_its_pyproject_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for c in ENVIRONMENTS.values():
        assert c.extra in extras, c.name
    assert extras["envs"] == [f"agentgym-platform[{','.join(c.extra for c in ENVIRONMENTS.values())}]"]


def test_an_unknown_name_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: babyai, deepsearch"):
        card("minecraft")
