#!/usr/bin/env bash
# MLflow in its own virtual environment (.venv-ui): `agentgym ui RUN_DIR`, `agentgym run --ui`, the UI tests.
# Its dependencies (Flask, SQLAlchemy, pandas, scikit-learn, ...) stay out of the platform's .venv; the platform
# talks to it over HTTP only. Idempotent: a ready environment is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${AGENTGYM_UI_VENV:-.venv-ui}
MLFLOW_VERSION=3.17.2  # agentgym.local.ui.MLFLOW_VERSION
STAMP="$VENV/.agentgym-mlflow-$MLFLOW_VERSION"

if [ -f "$STAMP" ] && "$VENV/bin/mlflow" --version >/dev/null 2>&1; then
  echo "UI environment ready: $VENV (mlflow $MLFLOW_VERSION)"
  exit 0
fi
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "mlflow==$MLFLOW_VERSION" 2>&1 \
  | grep -v -E "^WARNING: Location .* is ignored" || true
"$VENV/bin/mlflow" --version
touch "$STAMP"
echo "UI environment ready: $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
