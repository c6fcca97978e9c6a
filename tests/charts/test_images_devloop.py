"""Images and the dev loop, checked statically (no container engine here): every deployable has a multi-stage,
non-root Dockerfile installing only its own extra; `skaffold.yaml` builds them all and hands each built
image to the chart value that deploys it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from agentgym.plan import TRAINER_MODULE

ROOT = Path(__file__).resolve().parents[2]
SKAFFOLD = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
ARTIFACTS = {a["image"]: a["docker"]["dockerfile"] for a in SKAFFOLD["build"]["artifacts"]}
# Deployable -> (Dockerfile, the pyproject extra it installs).
OWN = {
    "agentgym/operator": ("operators/operator.Dockerfile", "operator"),
    "agentgym/rollout": ("services/rollout/rollout.Dockerfile", "rollout"),
    "agentgym/trainer": ("trainer/trainer.Dockerfile", "trainer"),
    "agentgym/inference-cpu": ("services/inference/inference-cpu.Dockerfile", "inference"),
}


def stages(dockerfile: Path) -> list[list[str]]:
    """Instruction lines per build stage (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    result: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            result.append([])
        if result:
            result[-1].append(line)
    return result


@pytest.mark.parametrize("image", sorted(ARTIFACTS))
def test_every_artifact_is_multi_stage_and_non_root(image: str) -> None:
    path = ROOT / ARTIFACTS[image]
    assert path.is_file(), f"{image}: {path} missing"
    built = stages(path)
    assert len(built) >= 2, f"{image}: not multi-stage"
    final = built[-1]
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    assert users and users[-1].isdigit() and int(users[-1]) > 0, (
        f"{image}: the final stage must run as a numeric non-root user"
    )
    assert any(line.upper().startswith("COPY --FROM=") for line in final), (
        f"{image}: the final stage copies the build's venv"
    )
    assert not any("pip install" in line for line in final), f"{image}: nothing is built in the final stage"
    assert any(line.upper().startswith(("ENTRYPOINT", "CMD")) for line in final)


@pytest.mark.parametrize("image", sorted(OWN))
def test_each_deployable_installs_only_its_own_extra(image: str) -> None:
    dockerfile, extra = OWN[image]
    assert ARTIFACTS[image] == dockerfile
    installs = " ".join(line for stage in stages(ROOT / dockerfile) for line in stage if "pip install" in line)
    extras = re.findall(r'"\.\[([a-z-]+)\]"', installs)
    assert extras == [extra], f"{image}: installs {extras}"


def test_environment_images_are_all_built() -> None:
    for dockerfile in sorted((ROOT / "services" / "envs").glob("*.Dockerfile")):
        image = f"agentgym/env-{dockerfile.name.removesuffix('.Dockerfile')}"
        assert ARTIFACTS.get(image) == f"services/envs/{dockerfile.name}", image


def _values_path(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"values.yaml has no {dotted}"
        node = node[part]
    return node


def test_skaffold_deploys_the_chart_with_every_built_image() -> None:
    releases = SKAFFOLD["deploy"]["helm"]["releases"]
    assert len(releases) == 1 and releases[0]["chartPath"] == "charts/agentgym"
    templates: dict[str, str] = releases[0]["setValueTemplates"]
    values = yaml.safe_load((ROOT / "charts" / "agentgym" / "values.yaml").read_text())
    wired = {}
    for key, template in templates.items():
        _values_path(values, key)
        match = re.fullmatch(r"\{\{\.IMAGE_FULLY_QUALIFIED_([A-Za-z0-9_]+)\}\}", template)
        assert match, template
        wired[match[1]] = key
    expected = {re.sub(r"[^A-Za-z0-9]", "_", image): image for image in ARTIFACTS}
    assert set(wired) == set(expected), "every built image must reach the chart"
    # What skaffold hands over (a full reference) is accepted by the schema and used as it is.
    reference = "registry.local/agentgym/rollout:dev@sha256:" + "0" * 64
    with helm.Chart.load(ROOT / "charts" / "agentgym") as chart:
        chart.validate_schema({"images": {"rollout": reference}})
        config = chart.render({"images": {"rollout": reference}}, name="agentgym", namespace="dev")
    assert f"rollout: {reference}" in config["agentgym/templates/operator-config.yaml"]


def test_trainer_image_runs_what_the_operator_starts() -> None:
    final = stages(ROOT / "trainer" / "trainer.Dockerfile")[-1]
    assert f'ENTRYPOINT ["python", "-m", "{TRAINER_MODULE}"]' in final
    build = " ".join(stages(ROOT / "trainer" / "trainer.Dockerfile")[0])
    assert '"torch==2.13.0"' in build and "deepspeed" in build
