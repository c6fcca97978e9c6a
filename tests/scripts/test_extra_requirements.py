"""scripts/extra-requirements.py: the requirement list each image's dependency layer installs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "extra-requirements.py"

PYPROJECT = """
[project]
name = "AgentGym_Platform"
dependencies = ["pydantic>=2", "pyyaml"]

[project.optional-dependencies]
server = ["fastapi>=0.115", "pyyaml"]
grid = ["agentgym-platform[server]", "numpy>=1.26"]
all = ["AgentGym.Platform[grid, server]", "other[server]>=1"]
none = []
"""


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, check=False)


def test_each_extra_lists_the_core_then_its_own_with_self_references_expanded(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    assert run(tmp_path / "pyproject.toml", tmp_path / "out").returncode == 0
    lists = {path.stem: path.read_text().splitlines() for path in (tmp_path / "out").glob("*.txt")}
    assert lists == {
        "server": ["pydantic>=2", "pyyaml", "fastapi>=0.115"],
        "grid": ["pydantic>=2", "pyyaml", "fastapi>=0.115", "numpy>=1.26"],
        # Another project's extras are a requirement as written; the project's own name matches normalised.
        "all": ["pydantic>=2", "pyyaml", "fastapi>=0.115", "numpy>=1.26", "other[server]>=1"],
        "none": ["pydantic>=2", "pyyaml"],
    }


def test_the_repositorys_lists_are_what_pip_would_install_for_each_extra(tmp_path: Path) -> None:
    assert run(ROOT / "pyproject.toml", tmp_path).returncode == 0
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    babyai = (tmp_path / "babyai.txt").read_text().splitlines()
    assert babyai == [
        *project["dependencies"],
        "fastapi>=0.115",
        "uvicorn[standard]>=0.30",
        "minigrid==3.2.0",
        "gymnasium>=1.0",
        "numpy>=1.26",
    ]
    assert sorted(path.stem for path in tmp_path.glob("*.txt")) == sorted(project["optional-dependencies"])
    assert not any("agentgym-platform" in (tmp_path / f"{e}.txt").read_text() for e in project["optional-dependencies"])


@pytest.mark.parametrize(
    ("extras", "message"),
    [
        ('a = ["agentgym-platform[b]"]', "agentgym-platform[b] names no extra"),
        ('a = ["agentgym-platform[b]"]\nb = ["agentgym-platform[a]"]', "cycle: a -> b -> a"),
    ],
)
def test_a_reference_to_a_missing_extra_or_a_cycle_is_an_error_naming_it(
    tmp_path: Path, extras: str, message: str
) -> None:
    (tmp_path / "pyproject.toml").write_text(
        f'[project]\nname = "agentgym-platform"\n[project.optional-dependencies]\n{extras}\n'
    )
    result = run(tmp_path / "pyproject.toml", tmp_path / "out")
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_usage(tmp_path: Path) -> None:
    result = run(tmp_path)
    assert result.returncode == 2 and "extra-requirements.py pyproject.toml OUT_DIR" in result.stderr
