"""TrainingRun spec: defaults, validation errors that name the field, CRD schema agreement."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from agentgym.proto.generate import REPO_ROOT
from agentgym.spec import SpecError, load_training_run, parse_training_run
from agentgym.spec.crd import crd_document

EXAMPLES = [p for p in sorted((REPO_ROOT / "examples").glob("*.yaml")) if "\nkind: TrainingRun" in p.read_text()]

MINIMAL: dict[str, Any] = {
    "apiVersion": "agentgym.io/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "demo"},
    "spec": {"model": {"name": "builtin:tiny"}, "environments": [{"name": "babyai"}]},
}


def with_spec(**changes: Any) -> dict[str, Any]:
    document = copy.deepcopy(MINIMAL)
    document["spec"].update(changes)
    return document


def errors_of(document: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_training_run(document)
    return caught.value.errors


def test_minimal_spec_gets_sensible_defaults() -> None:
    run = parse_training_run(MINIMAL)
    spec = run.spec
    assert spec.algorithm.name == "grpo" and spec.algorithm.group_size == 8
    assert spec.curriculum.kind == "scaling_inter"
    assert spec.curriculum.horizon_stages("babyai") == [6, 13, 20]
    assert spec.curriculum.steps_per_stage("webarena") == 80
    assert spec.environments[0].split == "train" and spec.environments[0].replicas.max == 1
    assert spec.rollout.max_staleness == 0
    document = run.to_document()
    assert document["spec"]["algorithm"]["groupSize"] == 8  # camelCase on the wire
    assert parse_training_run(document) == run  # round trip


def test_each_environment_has_its_own_horizons() -> None:
    """An environment's own horizons, else the curriculum's, else (neither given) the paper's for that environment."""
    spec = parse_training_run(
        with_spec(
            environments=[{"name": "babyai"}, {"name": "textcraft", "horizons": [4, 6, 8]}, {"name": "sciworld"}],
            curriculum={"horizons": [2, 3, 5]},
        )
    ).spec
    assert [spec.horizon_stages(name) for name in ("babyai", "textcraft", "sciworld")] == [
        [2, 3, 5],
        [4, 6, 8],
        [2, 3, 5],
    ]
    paper = parse_training_run(with_spec(environments=[{"name": "babyai"}, {"name": "textcraft"}])).spec
    assert (paper.horizon_stages("babyai"), paper.horizon_stages("textcraft")) == ([6, 13, 20], [10, 20, 30])


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"algorithm": {"groupSize": 0}}, "spec.algorithm.groupSize: Input should be greater than or equal to 1"),
        ({"algorithm": {"name": "rloo", "groupSize": 1}}, "spec.algorithm: groupSize must be >= 2 for rloo"),
        (
            {"algorithm": {"name": "ppo", "turnValidityCoef": 0.5}},
            "spec.algorithm: turnValidityCoef is for grpo and rloo",
        ),
        (
            {"algorithm": {"negativeAdvantageScale": 2}},
            "spec.algorithm.negativeAdvantageScale: Input should be less than or equal to 1",
        ),
        (
            {"algorithm": {"name": "reinforce_plus_plus", "stepGroupCoef": 1.0}},
            "spec.algorithm: stepGroupCoef is for grpo and rloo",
        ),
        (
            {"algorithm": {"name": "ppo", "dropUniformGroups": True}},
            "spec.algorithm: dropUniformGroups is for grpo and rloo",
        ),
        (
            {"algorithm": {"stepGroupGamma": 1.5}},
            "spec.algorithm.stepGroupGamma: Input should be less than or equal to 1",
        ),
        (
            {"algorithm": {"turnValidityCoef": -1}},
            "spec.algorithm.turnValidityCoef: Input should be greater than or equal to 0",
        ),
        ({"algorithm": {"name": "a2c"}}, "spec.algorithm.name: Input should be 'grpo', 'ppo', 'rloo'"),
        ({"algorithm": {"learningRate": 0}}, "spec.algorithm.learningRate: Input should be greater than 0"),
        ({"environments": []}, "spec.environments: List should have at least 1 item"),
        ({"environments": [{"name": "chess"}]}, "spec.environments[0].name: Input should be 'babyai'"),
        (
            {"environments": [{"name": "babyai", "replicas": {"min": 3, "max": 2}}]},
            "spec.environments[0].replicas: max (2) must be >= min (3)",
        ),
        ({"environments": [{"name": "babyai"}, {"name": "babyai"}]}, "spec: environments listed twice: babyai"),
        ({"curriculum": {"horizons": [6, 6, 20]}}, "spec.curriculum: horizons must increase stage by stage"),
        (
            {"environments": [{"name": "babyai", "horizons": [3, 2]}]},
            "spec.environments[0]: horizons must increase stage by stage, got [3, 2]",
        ),
        (
            {
                "environments": [{"name": "babyai"}, {"name": "textcraft", "horizons": [4, 8]}],
                "curriculum": {"horizons": [2, 3, 5]},
            },
            "spec: every environment needs as many horizons as the curriculum has stages, got babyai 3, textcraft 2",
        ),
        (
            {"environments": [{"name": "babyai", "horizons": [4, 8]}], "curriculum": {"kind": "fixed"}},
            "spec: environments[].horizons (babyai) need curriculum kind scaling_inter",
        ),
        (
            {"curriculum": {"kind": "adaptive", "adaptive": {"initial": 50, "maximum": 30}}},
            "spec.curriculum.adaptive: need minimum <= initial <= maximum",
        ),
        ({"rollout": {"topP": 1.5}}, "spec.rollout.topP: Input should be less than or equal to 1"),
        ({"trainer": {"backend": "deepspeed"}}, "spec.trainer: backend deepspeed needs gpus >= 1"),
        (
            {"trainer": {"gpus": 2}},
            "spec.trainer: backend torch trains on one device, not gpus: 2; use backend deepspeed",
        ),
        ({"trainer": {"sftThoughts": "maybe"}}, "spec.trainer.sftThoughts: Input should be a valid boolean"),
        (
            {"algorithm": {"turnValidityNeedsSuccess": "sometimes"}},
            "spec.algorithm.turnValidityNeedsSuccess: Input should be a valid boolean",
        ),
        ({"inference": {"engine": "hf", "tensorParallel": 2}}, "spec.inference: tensorParallel must be 1"),
        (
            {"inference": {"engine": "vllm", "gpusPerReplica": 0, "dataParallel": 2}},
            "spec.inference: dataParallel > 1 is for the hf engine on CPU",
        ),
        (
            {"inference": {"engine": "hf", "gpusPerReplica": 1, "dataParallel": 2}},
            "spec.inference: dataParallel > 1 is for the hf engine on CPU",
        ),
        ({"inference": {"dataParallel": 0}}, "spec.inference.dataParallel: Input should be greater than or equal to 1"),
        ({"algoritm": {}}, "spec.algoritm: Extra inputs are not permitted"),
    ],
)
def test_invalid_specs_name_the_field(changes: dict[str, Any], expected: str) -> None:
    lines = errors_of(with_spec(**changes))
    assert any(line.startswith(expected) for line in lines), lines


def test_metadata_and_document_errors() -> None:
    bad_name = copy.deepcopy(MINIMAL)
    bad_name["metadata"]["name"] = "Not_A_DNS_Name"
    assert any(line.startswith("metadata.name:") for line in errors_of(bad_name))
    no_spec = {k: v for k, v in MINIMAL.items() if k != "spec"}
    assert "spec: Field required" in errors_of(no_spec)
    assert errors_of([1, 2]) == ["(document): expected a mapping, got list"]  # type: ignore[arg-type]


def test_load_reports_file_problems(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        load_training_run(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    with pytest.raises(SpecError, match=r"\(yaml\)"):
        load_training_run(broken)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_validate_with_model_and_crd_schema(path: Path) -> None:
    load_training_run(path)
    schema = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(yaml.safe_load(path.read_text()), _as_json_schema(schema))


def test_crd_schema_rejects_what_the_model_rejects() -> None:
    schema = _as_json_schema(crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    with pytest.raises(jsonschema.ValidationError, match=r"groupSize|0 is less than"):
        jsonschema.validate(with_spec(algorithm={"groupSize": 0}), schema)
    with pytest.raises(jsonschema.ValidationError, match="chess"):
        jsonschema.validate(with_spec(environments=[{"name": "chess"}]), schema)


def test_crd_has_printer_columns_status_and_immutable_fields() -> None:
    version = crd_document()["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Phase", "Step", "Horizon", "Reward", "Age"]
    assert version["subresources"] == {"status": {}}
    spec_props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec_props["model"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["items"]["properties"]["type"]["enum"][:2] == ["Ready", "EnvironmentsReady"]


def _as_json_schema(openapi: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3 (Kubernetes flavour) -> JSON Schema draft 4 for jsonschema: nullable -> null type."""

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
        if out.pop("nullable", False) and "type" in out:
            out["type"] = [out["type"], "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        return out

    converted: dict[str, Any] = convert(openapi)
    converted["$schema"] = "http://json-schema.org/draft-04/schema#"
    return converted
