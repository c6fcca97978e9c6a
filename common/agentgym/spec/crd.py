"""Generate the TrainingRun CustomResourceDefinition from the pydantic spec.

Kubernetes wants a *structural* OpenAPI v3 schema: no `$ref`, no `anyOf` for nullability, no
`additionalProperties` beside `properties`, `exclusiveMinimum` as a boolean. This module turns
pydantic's JSON Schema into that form so the CRD can never drift from the model.

Usage: ``python -m agentgym.spec.crd charts/agentgym/crds/trainingruns.yaml``
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from agentgym.spec import API_GROUP, API_VERSION, KIND, PLURAL, TrainingRunSpec, TrainingRunStatus

# Fields fixed for the life of a run (CEL transition rules; the API server rejects changes): everything the
# trainer reads when it starts. What stays mutable: rollout.workers/concurrency, inference, telemetry, suspend.
IMMUTABLE_SPEC_FIELDS = ("model", "environments", "algorithm", "curriculum", "trainer", "storage", "messaging")
IMMUTABLE_NESTED_FIELDS = {"rollout": ("tasksPerStep", "maxTokensPerTurn", "temperature", "topP", "maxStaleness")}

_DROP_KEYS = {"title", "additionalProperties", "$defs", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        target.update(extra)
        return _resolve(target, defs)
    return {key: _resolve(value, defs) for key, value in node.items()}


def _structural(node: Any) -> Any:
    """Rewrite one (resolved) JSON-Schema node into Kubernetes' structural subset."""
    if isinstance(node, list):
        return [_structural(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [branch for branch in any_of if branch.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express union {any_of} structurally")
        merged = {**non_null[0], **node}
        if len(non_null) < len(any_of):
            merged["nullable"] = True
        if merged.get("default", "absent") is None:
            merged.pop("default")
        return _structural(merged)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node.pop("exclusiveMinimum")
        node["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"] = node.pop("exclusiveMaximum")
        node["exclusiveMaximum"] = True
    if "enum" in node and "type" not in node:
        values = node["enum"]
        if all(isinstance(v, bool) for v in values):
            node["type"] = "boolean"
        elif all(isinstance(v, int) for v in values):
            node["type"] = "integer"
        elif all(isinstance(v, str) for v in values):
            node["type"] = "string"
    additional = node.get("additionalProperties")
    if node.get("type") == "object" and "properties" not in node:
        if isinstance(additional, dict) and additional:
            node["additionalProperties"] = _structural(additional)
        else:
            node.pop("additionalProperties", None)
            node["x-kubernetes-preserve-unknown-fields"] = True
        return {k: v for k, v in node.items() if k not in _DROP_KEYS - {"additionalProperties"}}
    out = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "properties":
            out[key] = {name: _structural(prop) for name, prop in value.items()}
        else:
            out[key] = _structural(value)
    return out


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a pydantic model (by alias, validation mode)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _structural(_resolve(raw, defs))
    return schema


def _default_objects(node: Any) -> None:
    """`default: {}` on optional, non-nullable object properties, so the API server fills in their nested
    defaults (and an omitted section can never be 'added' later past an immutability rule)."""
    if not isinstance(node, dict):
        return
    required = set(node.get("required", []))
    for name, prop in node.get("properties", {}).items():
        if (
            name not in required
            and prop.get("type") == "object"
            and "properties" in prop
            and not prop.get("nullable")
            and "default" not in prop
        ):
            prop["default"] = {}
        _default_objects(prop)
    _default_objects(node.get("items"))


def crd_document() -> dict[str, Any]:
    spec_schema = openapi_schema(TrainingRunSpec)
    _default_objects(spec_schema)
    for field in IMMUTABLE_SPEC_FIELDS:
        prop = spec_schema["properties"][field]
        prop.setdefault("x-kubernetes-validations", []).append(
            {"rule": "self == oldSelf", "message": f"spec.{field} cannot change during a run"}
        )
    for parent, fields in IMMUTABLE_NESTED_FIELDS.items():
        for field in fields:
            prop = spec_schema["properties"][parent]["properties"][field]
            prop.setdefault("x-kubernetes-validations", []).append(
                {"rule": "self == oldSelf", "message": f"spec.{parent}.{field} cannot change during a run"}
            )
    status_schema = openapi_schema(TrainingRunStatus)
    status_schema["properties"]["conditions"]["x-kubernetes-list-type"] = "map"
    status_schema["properties"]["conditions"]["x-kubernetes-list-map-keys"] = ["type"]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["tr", "trun"],
                "categories": ["agentgym"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
                        {"name": "Horizon", "type": "integer", "jsonPath": ".status.horizon"},
                        {"name": "Reward", "type": "number", "jsonPath": ".status.reward"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A multi-turn online RL training run of an LLM agent.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = "# Generated from agentgym.spec by `make crd`; do not edit (tests/common/test_crd_current.py checks it).\n"


def render_crd() -> str:
    return HEADER + yaml.safe_dump(crd_document(), sort_keys=False, width=120)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("charts/agentgym/crds/trainingruns.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_crd())
    print(out)


if __name__ == "__main__":
    main()
