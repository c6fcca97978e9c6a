#!/usr/bin/env bash
# Installs the platform into a vLLM environment so vLLM finds its plugins through the `vllm.general_plugins` entry
# point (agentgym.inference.vllm_disk_backend: the `disk` weight-transfer backend). No dependencies: vLLM's
# environment keeps its own (transformers, torch, ...). Editable from the source folder, so the plugin is the
# checkout's code. The one command both scripts/setup-vllm.sh (.venv-vllm, the tests) and
# services/inference/vllm.Dockerfile (the GPU image) run:
#
#   bash scripts/install-vllm-plugin.sh PYTHON [SOURCE]    # SOURCE: the repository (default: this script's)
set -euo pipefail

python=${1:?usage: install-vllm-plugin.sh PYTHON [SOURCE]}
source_dir=${2:-$(cd "$(dirname "$0")/.." && pwd)}

"$python" -m pip install -q --disable-pip-version-check --no-deps -e "$source_dir"
"$python" - <<'PY'
from importlib.metadata import entry_points

names = sorted(ep.name for ep in entry_points(group="vllm.general_plugins"))
if "agentgym_disk_weight_transfer" not in names:
    raise SystemExit(f"the platform's vLLM plugin is not registered (vllm.general_plugins: {names})")
print("vllm.general_plugins:", ", ".join(names))
PY
