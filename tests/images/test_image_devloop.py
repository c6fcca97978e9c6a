"""The images' dev loop, on real builds: a source edit rebuilds the layer that installs the platform and the final
stage's copy of it, never the dependency layers (the minutes of a cold build) nor the copy of the venv; an edit of a
requirement rebuilds them."""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from image_helpers import BUILD_SCRIPT, CACHE, ROOT, BuiltImage, built_reference, podman, podman_env

pytestmark = [pytest.mark.images, pytest.mark.slow]

DEPENDENCIES = "RUN pip install --no-cache-dir -r /requirements/operator.txt"
PLATFORM = "RUN pip install --no-cache-dir --no-deps --target /opt/agentgym-platform ."


def build_steps(log: str) -> dict[str, bool]:
    """Each layer step of a `podman build` log (FROM left out) -> whether it came from the layer cache."""
    chunks = re.split(r"^(?:\[\d+/\d+\] )?STEP \d+/\d+: (.*)$", log, flags=re.M)
    return {step: "--> Using cache " in body for step, body in zip(chunks[1::2], chunks[2::2], strict=True)}


def test_build_steps_reads_podmans_log() -> None:
    log = (
        "[1/2] STEP 1/2: FROM base AS a\n[1/2] STEP 2/2: COPY a /a\n--> Using cache 0af\n--> 0af\n"
        "[2/2] STEP 1/2: FROM base\n[2/2] STEP 2/2: RUN make\nbuilt\n--> 5c1\n"
    )
    assert build_steps(log) == {"FROM base AS a": False, "COPY a /a": True, "FROM base": False, "RUN make": False}


def checkout_copy(destination: Path) -> Path:
    """The files git knows of (tracked, and untracked but not ignored), as a fresh clone would have them."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def build_operator(tree: Path, tag: str) -> dict[str, bool]:
    result = subprocess.run(
        ["bash", str(tree / BUILD_SCRIPT.relative_to(ROOT)), "operator"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**podman_env(), "AGENTGYM_IMAGE_TAG": tag},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"^operator\s+\d+ MB\s+\d+ s\s+\d+/\d+ cached$", result.stdout, re.M), result.stdout
    return build_steps((CACHE / "logs" / "operator.log").read_text())


def test_a_source_edit_rebuilds_the_platform_layer_only(built_images: dict[str, BuiltImage], tmp_path: Path) -> None:
    built_reference(built_images, "operator")  # the cache this reuses: the session's operator build
    tree = checkout_copy(tmp_path / "tree")
    # Edits no earlier run made: podman's cache keeps the layers of every build, this test's included.
    nonce = uuid.uuid4().int % 10**12
    source = tree / "operators" / "agentgym" / "operator" / "__init__.py"
    source.write_text(source.read_text() + f"\n# an edit {nonce}\n")
    tag = "devloop-test"
    try:
        edited = build_operator(tree, tag)
        assert edited[DEPENDENCIES] and not edited[PLATFORM], edited
        assert not edited["COPY operators operators"] and edited["COPY common common"], edited
        # The final stage reuses its copy of the venv (the dependencies): only the platform's folder is new.
        assert edited["COPY --from=build /opt/venv /opt/venv"], edited
        assert not edited["COPY --from=build /opt/agentgym-platform /opt/agentgym-platform"], edited
        # An image of the edit: the platform installed from the edited sources.
        shown = podman(
            "run",
            "--rm",
            "--pull=never",
            "--entrypoint",
            '["python", "-c", "import agentgym.operator, inspect; print(inspect.getsource(agentgym.operator)[-40:])"]',
            f"localhost/agentgym/operator:{tag}",
        )
        assert f"# an edit {nonce}" in shown.stdout
        pyproject = tree / "pyproject.toml"
        required = f'operator = ["kopf>=1.37,!=0.0.{nonce}"]'  # the same kopf, a requirement list of its own
        pyproject.write_text(pyproject.read_text().replace('operator = ["kopf>=1.37"]', required))
        steps = build_operator(tree, tag)
        assert not steps[DEPENDENCIES] and not steps[PLATFORM], steps
    finally:
        podman("rmi", "--force", f"localhost/agentgym/operator:{tag}", check=False)
