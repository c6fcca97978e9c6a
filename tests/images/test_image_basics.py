"""Every built image: its size against the recorded one, its own non-root user, a read-only root filesystem."""

from __future__ import annotations

import json
import re

import pytest
from image_helpers import CACHE, IMAGE_NAMES, SIZES_FILE, BuiltImage, built_reference, podman, run_once

pytestmark = [pytest.mark.images, pytest.mark.slow]

GROWTH_LIMIT = 1.20
"""An image may grow by 20 % over its recorded size (tests/images/sizes.json) before this fails."""

USER = "10001"
PROBE = """
import os, sys
print("uid", os.getuid(), "gid", os.getgid())
for path in ("/opt/venv/probe", "/etc/probe"):
    try:
        open(path, "w").close()
    except OSError as error:
        print("read-only", path, error.errno)
    else:
        sys.exit(f"{path} is writable")
open("/tmp/probe", "w").write("ok")
print("tmp", open("/tmp/probe").read())
"""


def test_sizes_within_the_recorded_ones(built_images: dict[str, BuiltImage]) -> None:
    recorded: dict[str, int] = json.loads(SIZES_FILE.read_text())["size_mb"]
    print("\nimage            size MB  recorded  build s")
    for name, image in sorted(built_images.items()):
        print(f"{name:16} {image.size_mb:7d} {recorded.get(name, 0):9d} {image.build_s:8d}")
    missing = sorted(set(built_images) - set(recorded))
    assert not missing, f"no recorded size for {missing}: add them to {SIZES_FILE.name}"
    grown = {
        name: f"{image.size_mb} MB, +{100 * (image.size_mb / recorded[name] - 1):.0f} % over {recorded[name]} MB"
        for name, image in built_images.items()
        if image.size_mb > recorded[name] * GROWTH_LIMIT
    }
    assert not grown, f"images grew by more than {100 * (GROWTH_LIMIT - 1):.0f} %: {grown}"


def test_a_full_build_leaves_no_superseded_image_behind(built_images: dict[str, BuiltImage]) -> None:
    """Untagged images a build did not use (an old build of a tag, a stage whose sources changed) are removed:
    each source edit left ~0.3 GB behind, and a machine that builds often ran out of disk. Runs before
    test_image_devloop, whose builds rewrite the operator's log."""
    if set(built_images) != set(IMAGE_NAMES):
        pytest.skip("the build of some images only: it removes nothing (the others' layer cache is unknown to it)")
    label = '{{index .Labels "agentgym.base-key"}}'
    base = podman("image", "inspect", "--format", label, "docker.io/library/python:3.11-slim")
    if not base.stdout.strip():
        pytest.skip("the base came from a registry (AGENTGYM_BASE_FROM_REGISTRY=1): the build removes nothing")
    logs = "".join((CACHE / "logs" / f"{name}.log").read_text() for name in IMAGE_NAMES)
    used = {match[:11] for match in re.findall(r"^--> (?:Using cache )?([0-9a-f]{11,})", logs, re.M)}
    ours = ["--filter", "dangling=true", "--filter", "label=agentgym.base-key"]  # built on the local base
    dangling = podman("images", *ours, "--format", "{{.ID}}").stdout.split()
    assert dangling, "a multi-stage build leaves its stages untagged: none found"
    assert all(image_id[:11] in used for image_id in dangling), sorted(
        set(dangling) - {i for i in dangling if i[:11] in used}
    )


@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_runs_as_its_own_non_root_user_on_a_read_only_root(built_images: dict[str, BuiltImage], name: str) -> None:
    image = built_reference(built_images, name)
    assert podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip() == USER
    # No --user: the image's own USER; --read-only with /tmp as the pods' emptyDir.
    options = ["--read-only", "--cap-drop=ALL", "--tmpfs", "/tmp:rw,mode=1777"]
    code, output = run_once(image, ["python", "-c", PROBE], options)
    assert code == 0, output
    assert f"uid {USER} " in output
    assert output.count("read-only") == 2 and "read-only /opt/venv/probe 30" in output  # EROFS
    assert "tmp ok" in output
