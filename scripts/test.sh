#!/usr/bin/env bash
# What CI runs: set up, lint, type-check, then the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-dev.sh
# podman and mmdebstrap installed (apt) before anything runs beside: two apt-gets at once fail on dpkg's lock.
# Where podman cannot run, the images tests skip, saying why.
podman_ok=1
bash scripts/build-images.sh --setup-only || podman_ok=0
# The side environments (.venv-vllm: the tests marked vllm run the real vLLM CPU server; .venv-ui: MLflow for the
# UI tests) install, mostly downloading, while lint and type checks use the CPU.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT  # the setup logs are printed below; nothing of them is left in /tmp
bash scripts/setup-vllm.sh >"$logs/vllm.log" 2>&1 &
vllm_pid=$!
bash scripts/setup-ui.sh >"$logs/ui.log" 2>&1 &
ui_pid=$!
# Kubernetes' real CRD server (the tests marked crd_server): built once from Debian sid's Go source (4-12 min on 2
# cores, overlapping the rest of the setup), then cached outside the repository (instant).
bash scripts/build-crd-server.sh >"$logs/crd.log" 2>&1 &
crd_pid=$!
# The images the images tests use (all, or those AGENTGYM_IMAGES names), built here beside the rest of the setup
# (a cold build is mostly downloading: Debian packages, wheels); the tests then take them as built
# (AGENTGYM_IMAGES_BUILT=1) rather than run a second build that finds every layer cached (~2 min: buildah hashes
# each final stage's 0.3-1.6 GB copy of its venv). A failure here is only printed: the tests build again and report.
images_pid=
if [ "$podman_ok" = 1 ]; then
  # shellcheck disable=SC2086  # the names, split
  bash scripts/build-images.sh ${AGENTGYM_IMAGES:-} >"$logs/images.log" 2>&1 &
  images_pid=$!
fi
checks=0
{ .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy; } || checks=$?
setups=0
wait "$vllm_pid" || { setups=1; echo "scripts/setup-vllm.sh failed:" >&2; }
tail -n 20 "$logs/vllm.log"
wait "$ui_pid" || { setups=1; echo "scripts/setup-ui.sh failed:" >&2; }
tail -n 20 "$logs/ui.log"
wait "$crd_pid" || { setups=1; echo "scripts/build-crd-server.sh failed:" >&2; }
tail -n 20 "$logs/crd.log"
if [ -n "$images_pid" ]; then
  if wait "$images_pid"; then
    export AGENTGYM_IMAGES_BUILT=1
    grep -v '^WARNING' "$logs/images.log" | tail -n 12
  else
    echo "scripts/build-images.sh failed (the images tests build again):" >&2
    tail -n 20 "$logs/images.log"
  fi
fi
[ "$checks" -eq 0 ] && [ "$setups" -eq 0 ] || exit 1
# The tests marked images build every image with podman (scripts/build-images.sh, installed here when missing) and
# run each as the chart runs it. Layers are cached in podman's storage: ~14 min cold on 2 cores, about a minute when
# only the platform's sources changed (dependencies install in layers keyed by the requirement lists alone): built
# above, beside the rest of the setup.
# AGENTGYM_IMAGES="operator env-babyai" narrows it; the tests of images not built then skip, saying so.
.venv/bin/pytest -q -p no:cacheprovider --durations=40 "$@"
