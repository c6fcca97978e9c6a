"""The images built and run here: every image of scripts/build-images.sh built once per session (podman)."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
from image_helpers import BUILD_SCRIPT, IMAGE_NAMES, BuiltImage, image_reference, podman, podman_env, selected_images


@pytest.fixture(scope="session")
def built_images() -> dict[str, BuiltImage]:
    """The images of scripts/build-images.sh (all, or those AGENTGYM_IMAGES names), built once (layers cached;
    AGENTGYM_IMAGES_BUILT=1: the images present, as `make images` left them); skipped only where podman cannot
    run."""
    setup = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--setup-only"], capture_output=True, text=True, timeout=600, check=False
    )
    if setup.returncode in (2, 3):  # podman missing and not installable here / installed but cannot run
        pytest.skip(f"podman cannot run here: {setup.stderr.strip()[-500:]}")
    assert setup.returncode == 0, setup.stderr
    listed = subprocess.run(["bash", str(BUILD_SCRIPT), "--list"], capture_output=True, text=True, check=True)
    assert listed.stdout.split() == IMAGE_NAMES, listed.stdout
    names = selected_images()
    if os.environ.get("AGENTGYM_IMAGES_BUILT") == "1":  # `make images` ran: test what it built, as it is
        present = {name: present_image(name) for name in names}
        return {name: image for name, image in present.items() if image is not None}
    start = time.monotonic()
    build = subprocess.run(
        ["bash", str(BUILD_SCRIPT), *names],
        capture_output=True,
        text=True,
        timeout=3000,
        env=podman_env(),
        check=False,
    )
    assert build.returncode == 0, f"scripts/build-images.sh failed:\n{build.stdout}\n{build.stderr[-6000:]}"
    images: dict[str, BuiltImage] = {}
    for line in build.stdout.splitlines():
        match = re.fullmatch(r"(\S+)\s+(\d+) MB\s+(\d+) s\s+\d+/\d+ cached", line.strip())
        if match:
            name = match[1]
            images[name] = BuiltImage(name, image_reference(name), int(match[2]), int(match[3]))
    print(f"\nimages built in {time.monotonic() - start:.0f} s:\n{build.stdout}")
    assert set(images) == set(names), build.stdout
    return images


def present_image(name: str) -> BuiltImage | None:
    reference = image_reference(name)
    inspected = podman("image", "inspect", "--format", "{{.Size}}", reference, check=False)
    if inspected.returncode != 0:
        return None
    return BuiltImage(name, reference, int(inspected.stdout.strip()) // 1_000_000, 0)
