"""scripts/venv-cache.sh: a venv built once per key, copied into each checkout with hard links, never changed there.

The setup scripts (setup-dev, setup-vllm, setup-ui) run it for real in CI; here a small build function stands in for
their pip installs: it writes a module and a console script as pip would, and counts its calls.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "scripts" / "venv-cache.sh"

BUILD = r"""
source "$LIBRARY"
build() {  # what pip does: a module in site-packages, a script whose interpreter line names this venv's python
  echo built >>"$BUILDS"
  [ "$KEY" != broken ] || exit 3
  site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "VALUE = '$KEY'" >"$site/cachedmod.py"
  printf '#!%s/bin/python\nimport cachedmod\nprint(cachedmod.VALUE)\n' "$1" >"$1/bin/show"
  chmod +x "$1/bin/show"
}
venv_from_cache demo "$KEY" "$VENV" build
"""


def setup(tmp_path: Path, checkout: str, key: str) -> subprocess.CompletedProcess[str]:
    """venv_from_cache in `checkout` (a folder of tmp_path) with `key`, the cache in tmp_path/cache."""
    folder = tmp_path / checkout
    folder.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "LIBRARY": str(LIBRARY),
        "AGENTGYM_VENV_CACHE": str(tmp_path / "cache"),
        "BUILDS": str(tmp_path / "builds"),
        "KEY": key,
        "VENV": ".venv",
    }
    return subprocess.run(["bash", "-euo", "pipefail", "-c", BUILD], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def builds(tmp_path: Path) -> int:
    path = tmp_path / "builds"
    return len(path.read_text().splitlines()) if path.exists() else 0


def show(venv: Path) -> str:
    return subprocess.run([str(venv / "bin" / "show")], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow
def test_a_venv_is_built_once_per_key_and_each_checkout_gets_its_own_linked_copy(tmp_path: Path) -> None:
    assert setup(tmp_path, "a", "k1").returncode == 0
    assert setup(tmp_path, "b", "k1").returncode == 0  # another checkout: copied, not built again
    assert builds(tmp_path) == 1
    cache = tmp_path / "cache" / "demo-k1"
    for checkout in ("a", "b"):
        venv = tmp_path / checkout / ".venv"
        # Its scripts run its own interpreter; its packages are the cache's files, hard-linked.
        assert (venv / "bin" / "show").read_text().splitlines()[0] == f"#!{venv}/bin/python"
        assert show(venv) == "k1"
        [module] = venv.glob("lib/python3*/site-packages/cachedmod.py")
        assert module.samefile(next(cache.glob("lib/python3*/site-packages/cachedmod.py")))
    # The cache's own script still names the cache's interpreter: rewriting a copy wrote a new file.
    assert (cache / "bin" / "show").read_text().splitlines()[0] == f"#!{cache}/bin/python"
    # Set up already: nothing is built or copied again.
    marker = tmp_path / "a" / ".venv" / "marker"
    marker.touch()
    assert setup(tmp_path, "a", "k1").returncode == 0 and marker.exists() and builds(tmp_path) == 1


@pytest.mark.slow
def test_a_new_key_rebuilds_the_two_newest_caches_stay_and_a_failed_build_is_never_used(tmp_path: Path) -> None:
    assert setup(tmp_path, "a", "k1").returncode == 0
    assert setup(tmp_path, "b", "k2").returncode == 0
    assert setup(tmp_path, "c", "k3").returncode == 0
    assert builds(tmp_path) == 3
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == ["demo-k2", "demo-k3"]
    assert show(tmp_path / "a" / ".venv") == "k1"  # its copy outlives the evicted cache: the files are its own too
    assert show(tmp_path / "c" / ".venv") == "k3"
    # A build that fails fails the setup and leaves no cache a later setup would take as built.
    failed = setup(tmp_path, "d", "broken")
    assert failed.returncode == 3 and not (tmp_path / "d" / ".venv").exists()
    assert not (tmp_path / "cache" / "demo-broken" / ".agentgym-venv-key").exists()
    assert setup(tmp_path, "d", "k4").returncode == 0 and show(tmp_path / "d" / ".venv") == "k4"
    assert not (tmp_path / "cache" / "demo-broken").exists()  # an unfinished build is removed by the next one
