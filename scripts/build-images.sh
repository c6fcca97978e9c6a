#!/usr/bin/env bash
# Builds every deployable image of the platform with podman (no docker daemon, no registry needed):
#
#   bash scripts/build-images.sh                 # setup + base image + every image below
#   bash scripts/build-images.sh operator babyai # some of them (names as in IMAGES below)
#   bash scripts/build-images.sh --setup-only    # podman installed and configured, nothing built
#   bash scripts/build-images.sh --list          # the names this script builds, one a line
#
# 1. Setup (idempotent): as root with apt, installs podman/buildah/runc/mmdebstrap when missing, and writes a
#    containers.conf for hosts like CI's (runc + cgroupfs; crun fails on hybrid cgroups; ulimits the sandbox can
#    grant). Use it yourself with `export CONTAINERS_CONF=$AGENTGYM_IMAGES_CACHE/containers.conf`.
# 2. The base: no registry is reachable here, so `python:3.11-slim` (the public name every Dockerfile uses) is
#    made locally from Debian bookworm with mmdebstrap (python3 3.11, venv, `python`, useradd, the CA bundle of
#    this host) and tagged docker.io/library/python:3.11-slim. Java 17 (SciWorld) and Chromium (WebArena) come
#    from the Dockerfiles' own apt lines. The tarball is cached outside the repository; a present base is kept.
#    Set AGENTGYM_BASE_FROM_REGISTRY=1 to pull the real python:3.11-slim instead.
# 3. Builds with --pull=never, layers cached (shared across images: same prefix, same layers). The host's pip
#    configuration (local wheel folders and indexes, CA bundle) is mounted into the builds as their package
#    cache, never copied into an image; torch comes from TORCH_INDEX_URL (default: PyTorch's CPU index; here the
#    local CPU wheel). Prints each image's size and build time.
#
# Not built here: the CUDA trainer (trainer/trainer.Dockerfile: nvidia/cuda cannot be pulled) and the vLLM GPU
# image (services/inference/vllm.Dockerfile: vllm/vllm-openai cannot be pulled). `trainer-cpu` is built instead,
# from the same install lines on the CPU torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${AGENTGYM_IMAGES_CACHE:-$HOME/.cache/agentgym-images}
TAG=${AGENTGYM_IMAGE_TAG:-latest}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
BASE=docker.io/library/python:3.11-slim
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates,passwd
HOST_CA=${AGENTGYM_HOST_CA:-/etc/ssl/certs/ca-certificates.crt}

# name -> Dockerfile (image agentgym/<name>; env images agentgym/env-<kind>).
declare -A IMAGES=(
  [operator]=operators/operator.Dockerfile
  [rollout]=services/rollout/rollout.Dockerfile
  [inference-cpu]=services/inference/inference-cpu.Dockerfile
  [trainer-cpu]=trainer/trainer-cpu.Dockerfile
  [env-babyai]=services/envs/babyai.Dockerfile
  [env-textcraft]=services/envs/textcraft.Dockerfile
  [env-deepsearch]=services/envs/deepsearch.Dockerfile
  [env-sciworld]=services/envs/sciworld.Dockerfile
  [env-webarena]=services/envs/webarena.Dockerfile
)
# Build order: inference-cpu first, its build stage is the models stage of rollout and trainer-cpu (shared layers).
ORDER=(operator inference-cpu rollout trainer-cpu env-babyai env-textcraft env-deepsearch env-webarena env-sciworld)

log() { printf '[build-images] %s\n' "$*" >&2; }

setup() {
  local missing=()
  for tool in podman buildah runc mmdebstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
      log "missing: ${missing[*]}; install podman, buildah, runc and mmdebstrap (root + apt does it here)"
      exit 2
    fi
    log "installing podman, buildah, skopeo, runc, CNI plugins, mmdebstrap"
    local packages=(podman buildah skopeo runc containernetworking-plugins mmdebstrap)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}" >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}" >/dev/null; }
  fi
  mkdir -p "$CACHE"
  local conf="$CACHE/containers.conf"
  local want
  want=$(cat <<'EOF'
# Written by scripts/build-images.sh: runc + cgroupfs (crun fails on hybrid cgroups), ulimits a sandbox grants.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
)
  if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$want" ]; then
    printf '%s\n' "$want" >"$conf"
  fi
  export CONTAINERS_CONF=${CONTAINERS_CONF:-$conf}
  podman info >/dev/null || { log "podman does not run here (see the error above)"; exit 3; }
}

make_base() {
  if [ "${AGENTGYM_BASE_FROM_REGISTRY:-0}" = 1 ]; then
    podman pull "$BASE"
    return
  fi
  # The key names what the base is made of: a different package list, mirror or CA bundle makes a new one.
  local key
  key=$( { echo "$BASE_PACKAGES $MIRROR $SECURITY_MIRROR"; cat "$HOST_CA" 2>/dev/null || true; } | sha256sum | cut -c1-16)
  if [ "$(podman image inspect --format '{{index .Labels "agentgym.base-key"}}' "$BASE" 2>/dev/null || true)" = "$key" ]; then
    log "base $BASE present ($key)"
    return
  fi
  local tarball="$CACHE/python-3.11-bookworm-$key.tar"
  if [ ! -f "$tarball" ]; then
    log "making $BASE with mmdebstrap from $MIRROR (cached in $tarball)"
    local start=$SECONDS hooks=()
    if [ -f "$HOST_CA" ]; then
      # This host's CA bundle (HTTPS from inside builds, e.g. pip behind an intercepting proxy), kept through
      # any later update-ca-certificates in an image.
      hooks+=(--customize-hook="mkdir -p \"\$1/usr/local/share/ca-certificates\""
              --customize-hook="copy-in $HOST_CA /usr/local/share/ca-certificates/"
              --customize-hook="mv \"\$1/usr/local/share/ca-certificates/$(basename "$HOST_CA")\" \"\$1/usr/local/share/ca-certificates/agentgym-host.crt\""
              --customize-hook="chroot \"\$1\" update-ca-certificates >/dev/null 2>&1")
    fi
    # shellcheck disable=SC2016  # "$1" is the hook's own argument (the new root), expanded by mmdebstrap
    mmdebstrap --quiet --format=tar --variant=minbase --include="$BASE_PACKAGES" --aptopt='APT::Install-Recommends "false"' \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
      "${hooks[@]}" \
      bookworm "$tarball.part" \
      "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" "deb $SECURITY_MIRROR bookworm-security main"
    mv "$tarball.part" "$tarball"
    log "mmdebstrap: $((SECONDS - start)) s"
  fi
  podman import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["python3"]' --change "LABEL agentgym.base-key=$key" \
    "$tarball" "$BASE" >/dev/null
  log "base $BASE imported ($key)"
}

# The host's pip configuration, for the builds: local folders (find-links, file:// indexes) mounted read-only at
# their own paths, and a pip.conf naming them (and the CA bundle) at /etc/pip.conf. Empty here: plain PyPI.
BUILD_MOUNTS=()
LOCAL_CPU_TORCH=0
pip_mounts() {
  local python
  python=$(command -v python3 || true)
  [ -n "$python" ] || return 0
  local conf="$CACHE/pip.conf"
  "$python" - "$conf" <<'PY' >"$CACHE/pip-mounts"
import os, subprocess, sys
def get(key: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""
env = {"find-links": "PIP_FIND_LINKS", "extra-index-url": "PIP_EXTRA_INDEX_URL", "index-url": "PIP_INDEX_URL"}
lines, mounts = ["[global]"], set()
for key, var in env.items():
    values = " ".join([os.environ.get(var, ""), get(f"global.{key}")]).split()
    values = list(dict.fromkeys(values))
    local = [v for v in values if v.startswith(("/", "file://"))]
    for value in local:
        path = value.removeprefix("file://")
        # A PEP 503 index links its files relative to itself (../../files/...): mount the folder above simple/.
        root = os.path.dirname(path.rstrip("/")) if path.rstrip("/").endswith("/simple") else path.rstrip("/")
        if os.path.isdir(root):
            mounts.add(root)
    if values:
        lines.append(f"{key} = {' '.join(values)}")
lines.append("cert = /etc/ssl/certs/ca-certificates.crt")
lines.append("disable-pip-version-check = true")
lines.append("default-timeout = 180")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
print("\n".join(sorted(mounts)))
PY
  BUILD_MOUNTS=(--volume "$conf:/etc/pip.conf:ro")
  local dir
  while IFS= read -r dir; do
    [ -n "$dir" ] || continue
    BUILD_MOUNTS+=(--volume "$dir:$dir:ro")
    if compgen -G "$dir/torch-*+cpu-*.whl" >/dev/null; then
      LOCAL_CPU_TORCH=1
    fi
  done <"$CACHE/pip-mounts"
}

image_name() {
  echo "localhost/agentgym/$1:$TAG"
}

build_one() {
  local name=$1 dockerfile=${IMAGES[$1]} start=$SECONDS args=()
  # Torch's CPU build: PyPI's Linux wheel is the CUDA one. A local CPU wheel (find-links) wins over PyPI here.
  if grep -q TORCH_INDEX_URL "$dockerfile"; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    elif [ "$LOCAL_CPU_TORCH" = 1 ]; then
      # pip prefers the local 2.13.0+cpu wheel (find-links) over PyPI's CUDA 2.13.0 for `torch==2.13.0`.
      args+=(--build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
    fi
  fi
  local build_log="$CACHE/logs/$name.log"
  mkdir -p "$CACHE/logs"
  log "building $(image_name "$name") from $dockerfile (log: $build_log)"
  if ! podman build --format docker --pull=never --layers --ignorefile "$CACHE/dockerignore" \
    "${BUILD_MOUNTS[@]}" "${args[@]}" -f "$dockerfile" -t "$(image_name "$name")" . >"$build_log" 2>&1; then
    log "building $name failed; the end of $build_log:"
    grep -v -e "is ignored: it is neither a file nor a directory" "$build_log" | tail -n 40 >&2
    exit 1
  fi
  local seconds=$((SECONDS - start)) size steps cached
  size=$(podman image inspect --format '{{.Size}}' "$(image_name "$name")")
  # Steps that make a layer (every one but FROM), and how many of them came from the layer cache.
  steps=$(grep -c -E '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/[0-9]+: ' "$build_log" || true)
  steps=$((steps - $(grep -c -E '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/[0-9]+: FROM ' "$build_log" || true)))
  cached=$(grep -c -e '^--> Using cache ' "$build_log" || true)
  printf '%-16s %6d MB %5d s %5s cached\n' "$name" $((size / 1000000)) "$seconds" "$cached/$steps" \
    | tee -a "$CACHE/build-times.txt"
}

# After a build of every image: the untagged images on the local base (its label) that no step of it used (an image
# its tag moved off, a build stage whose sources changed) are removed, with the layers only they held; the machine's
# other images are left alone. Each source edit otherwise leaves ~0.3 GB behind on a machine that builds often (CI's
# filled its disk); the layer cache of this build is what its steps used, so it stays.
remove_superseded() {
  local used removed=0 id
  used=$(sed -n -E 's/^--> (Using cache )?([0-9a-f]{11,}).*/\2/p' "$CACHE"/logs/*.log | cut -c1-11 | sort -u)
  while IFS= read -r id; do
    [ -n "$id" ] || continue
    grep -qx "${id:0:11}" <<<"$used" && continue
    if podman rmi "$id" >/dev/null 2>&1; then
      removed=$((removed + 1))
    fi
  done < <(podman images --filter dangling=true --filter label=agentgym.base-key --format '{{.ID}}')
  log "removed $removed superseded untagged images (and their own layers)"
}

# A clear word before a build that will run out of disk (buildah's own error names a temporary file).
check_space() {
  local root free_gb
  root=$(podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers/storage)
  mkdir -p "$root"
  free_gb=$(df --output=avail -BG "$root" | tail -n 1 | tr -dc '0-9')
  if [ "${free_gb:-0}" -lt 12 ]; then
    log "warning: ${free_gb} GB free under $root; a cold build of every image takes ~10 GB there"
  fi
}

main() {
  local setup_only=0 names=()
  for arg in "$@"; do
    case $arg in
      --setup-only) setup_only=1 ;;
      --list) printf '%s\n' "${ORDER[@]}"; return ;;
      -h|--help) sed -n '2,26p' "$0"; return ;;
      *) [ -n "${IMAGES[$arg]:-}" ] || { log "unknown image $arg; known: ${ORDER[*]}"; exit 2; }; names+=("$arg") ;;
    esac
  done
  setup
  [ "$setup_only" = 1 ] && { log "podman ready: export CONTAINERS_CONF=$CONTAINERS_CONF"; return; }
  [ "${#names[@]}" -gt 0 ] || names=("${ORDER[@]}")
  local start=$SECONDS
  check_space
  make_base
  pip_mounts
  # The build context is the repository: leave out what no image needs (virtual environments, caches, git).
  printf '%s\n' .git '.venv*' '**/__pycache__' '**/*.pyc' '.mypy_cache' '.ruff_cache' '.pytest_cache' \
    'runs' 'outputs' >"$CACHE/dockerignore"
  : >"$CACHE/build-times.txt"
  printf '%-16s %9s %7s %12s\n' image size build 'layer steps'
  for name in "${names[@]}"; do
    build_one "$name"
  done
  [ "${#names[@]}" -eq "${#ORDER[@]}" ] && remove_superseded
  log "all done in $((SECONDS - start)) s (CONTAINERS_CONF=$CONTAINERS_CONF)"
}

main "$@"
