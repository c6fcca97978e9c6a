#!/usr/bin/env bash
# The main job on the embedded default, for now: serve BabyAI and play an expert episode through its API.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-dev.sh
.venv/bin/agentgym env play babyai --split test --index 0
