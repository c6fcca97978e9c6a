#!/usr/bin/env bash
# The repository's GPU checks as one script, for a lent GPU machine (DEVELOPERS.md: the device tool):
#   1. benchmarks/trainer_gpu_bench.py    the trainer step's tokens/s and MFU vs naive HF (Qwen2.5 0.5B, 1.5B shapes)
#   2. benchmarks/inference_gpu_bench.py  the inference engine on a rollout-shaped workload at batch 64, 0.5B shape
# That machine has torch, transformers, tokenizers, aiohttp, httpx, protobuf, prometheus-client and pyyaml, but no
# network, not this package, not pydantic, and not SmolLM2's tokenizer (built here from a wheel). So:
#   here:   bash scripts/gpu-benchmarks.sh --prepare   fills .gpu-carry/ (git-ignored): pydantic's wheels for
#           CPython 3.12 and the tokenizer folder;
#   there:  bash scripts/gpu-benchmarks.sh             with carry [".gpu-carry"]; the package runs from this source
#           tree (PYTHONPATH), logs go to $OUT (else ./gpu-logs). About 6 minutes on an H100/H200.
#   --smoke runs the same steps on CPU with both benchmarks' smoke shapes (tests/scripts/test_gpu_benchmarks_script.py).
# vLLM, the production engine on GPUs, is not on that machine's image and cannot travel there (a ~400 MB wheel,
# 64 MiB a call): inference_gpu_bench.py --server measures it where it is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=${AGENTGYM_GPU_CARRY:-.gpu-carry}
PYTHON=${PYTHON:-python3}

if [[ "${1:-}" == "--prepare" ]]; then
  mkdir -p "$CARRY/wheels"
  for package in pydantic pydantic-core annotated-types typing-inspection; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$package'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$CARRY/wheels" "$package==$version"
  done
  tokenizer=$(.venv/bin/python -c "from agentgym.inference.models import smollm2_tokenizer_dir as d; print(d())")
  rm -rf "$CARRY/tokenizer" && cp -r "$tokenizer" "$CARRY/tokenizer"
  du -sh "$CARRY"
  exit 0
fi

smoke=() inference_smoke=()
[[ "${1:-}" == "--smoke" ]] && smoke=(--smoke) inference_smoke=(--smoke --repeats 1)
if [[ ! -f "$CARRY/tokenizer/tokenizer.json" ]]; then
  echo "gpu-benchmarks: no $CARRY/tokenizer: run 'bash scripts/gpu-benchmarks.sh --prepare' here, carry $CARRY" >&2
  exit 1
fi
site=$(mktemp -d "${TMPDIR:-/tmp}/agentgym-site.XXXXXX")
trap 'rm -rf "$site"' EXIT  # every CI run left one behind
shopt -s nullglob
wheels=("$CARRY"/wheels/*.whl)
if (( ${#wheels[@]} )); then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}"
fi
# The package's source roots (each holds an `agentgym/` namespace part), then the carried wheels.
roots=$(find . -maxdepth 3 -type d -name agentgym -not -path "./.*" -not -path "./node_modules*" -printf '%h:')
export PYTHONPATH="${roots}${site}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
logs=${OUT:-gpu-logs}
mkdir -p "$logs"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$logs/gpu.txt"
fi
status=0
timeout 360 "$PYTHON" benchmarks/trainer_gpu_bench.py "${smoke[@]}" 2>&1 | tee "$logs/trainer_gpu_bench.txt" || status=1
timeout 240 "$PYTHON" benchmarks/inference_gpu_bench.py --tokenizer "$CARRY/tokenizer" "${inference_smoke[@]}" 2>&1 \
  | tee "$logs/inference_gpu_bench.txt" || status=1
echo "gpu-benchmarks: logs in $logs (exit $status)"
exit "$status"
