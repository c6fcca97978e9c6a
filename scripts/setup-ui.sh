#!/usr/bin/env bash
# MLflow in its own virtual environment (.venv-ui): `agentgym ui RUN_DIR`, `agentgym run --ui`, the UI tests.
# Its dependencies (Flask, SQLAlchemy, pandas, scikit-learn, ...) stay out of the platform's .venv; the platform
# talks to it over HTTP only. Built once into a cache every checkout copies (scripts/venv-cache.sh); idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${AGENTGYM_UI_VENV:-.venv-ui}
MLFLOW_VERSION=3.17.2  # agentgym.local.ui.MLFLOW_VERSION
# shellcheck source=scripts/venv-cache.sh
source scripts/venv-cache.sh

install_mlflow() {  # $1: the (cached) venv to install MLflow into
  "$1/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$1/bin/python" -m pip install -q --disable-pip-version-check "mlflow==$MLFLOW_VERSION" 2>&1 \
    | grep -v -E "^WARNING: Location .* is ignored" || true
  "$1/bin/mlflow" --version >/dev/null
}

start=$(date +%s)
venv_from_cache ui "$(venv_key scripts/setup-ui.sh)" "$VENV" install_mlflow
installed=$("$VENV/bin/python" -c "from importlib.metadata import version; print(version('mlflow'))")
echo "UI environment ready: $VENV (mlflow $installed) in $(( $(date +%s) - start )) s"
