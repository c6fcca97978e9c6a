#!/usr/bin/env bash
# The main job on the embedded default: the quickstart TrainingRun on local processes (embedded NATS, the
# BabyAI service, CPU inference, a rollout worker, the trainer). ~9 minutes on 2 cores; it prints held-out
# success before training, after the SFT warm-up and at the end. Each run gets a fresh run directory.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-dev.sh
.venv/bin/agentgym run examples/quickstart.yaml --run-dir "runs/quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
