#!/usr/bin/env bash
# What CI runs: set up, lint, type-check, then the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-dev.sh
# The side environments (.venv-vllm: the tests marked vllm run the real vLLM CPU server; .venv-ui: MLflow for the
# UI tests) install, mostly downloading, while lint and type checks use the CPU.
logs=$(mktemp -d)
bash scripts/setup-vllm.sh >"$logs/vllm.log" 2>&1 &
vllm_pid=$!
bash scripts/setup-ui.sh >"$logs/ui.log" 2>&1 &
ui_pid=$!
checks=0
{ .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy; } || checks=$?
setups=0
wait "$vllm_pid" || { setups=1; echo "scripts/setup-vllm.sh failed:" >&2; }
tail -n 20 "$logs/vllm.log"
wait "$ui_pid" || { setups=1; echo "scripts/setup-ui.sh failed:" >&2; }
tail -n 20 "$logs/ui.log"
[ "$checks" -eq 0 ] && [ "$setups" -eq 0 ] || exit 1
# The tests marked images build their images with podman (scripts/build-images.sh, installed here when missing).
# Every image cold takes ~14 min on 2 cores, past CI's budget: by default this builds and runs the operator's and two
# environments' images (~4 min: podman, the local base, the chart's operator pod and Helm test, the env pods);
# `make test-images` (or AGENTGYM_IMAGES="...") builds and tests all of them, and the others skip here saying so.
export AGENTGYM_IMAGES=${AGENTGYM_IMAGES:-operator env-babyai env-textcraft}
.venv/bin/pytest -q -p no:cacheprovider --durations=15 "$@"
