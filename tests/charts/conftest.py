"""The chart's CRD is checked with the Kubernetes emulator's structural-schema code, which lives with the
operator tests (tests/operator/kube_emulator.py): put that folder on the import path."""

from __future__ import annotations

import sys
from pathlib import Path

_OPERATOR_TESTS = str(Path(__file__).resolve().parents[1] / "operator")
if _OPERATOR_TESTS not in sys.path:
    sys.path.insert(0, _OPERATOR_TESTS)
