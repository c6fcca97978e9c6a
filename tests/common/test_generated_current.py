"""Generated artifacts must match their sources: protobuf code and the TrainingRun CRD."""

from __future__ import annotations

from pathlib import Path

from agentgym.proto.generate import REPO_ROOT, generate
from agentgym.spec.crd import render_crd


def test_protobuf_code_is_current(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    committed_dir = REPO_ROOT / "common" / "agentgym" / "proto"
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = committed_dir / path.name
        assert committed.exists(), f"{path.name} is not committed; run `make proto`"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale; run `make proto`"
    committed_names = {p.name for p in committed_dir.glob("*_pb2*.py*")}
    assert committed_names == {p.name for p in fresh}, "generated files without a .proto source; run `make proto`"


def test_crd_is_current() -> None:
    committed = REPO_ROOT / "charts" / "agentgym" / "crds" / "trainingruns.yaml"
    assert committed.read_text() == render_crd(), "the CRD differs from agentgym.spec; run `make crd`"
