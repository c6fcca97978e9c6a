#!/usr/bin/env bash
# Builds a real Kubernetes CRD server (k8s.io/apiextensions-apiserver) and etcd, for tests/crd:
#
#   bash scripts/build-crd-server.sh           # build once (cached), print the binaries' paths
#   bash scripts/build-crd-server.sh --path    # the folder the binaries are in (nothing built)
#
# No kube-apiserver runs on these machines and no registry is reachable, but Debian sid packages the
# apiextensions-apiserver's Go source (golang-k8s-apiextensions-apiserver-dev, 0.36.x) and etcd (etcd-server).
# This makes a sid root with mmdebstrap (root + apt; ≈ 400 MB of packages), builds the server there with Debian's
# Go in GOPATH mode (≈ 10 CPU-minutes, CGO off: a static binary that runs on the host), and copies it and sid's
# etcd out. Everything is cached in $AGENTGYM_CRD_CACHE (default ~/.cache/agentgym-crd), outside the repository;
# a present binary is kept. The sid root is deleted afterwards unless AGENTGYM_CRD_KEEP_ROOT=1.
#
# What this server is: the CRD registration, schema defaulting/pruning/validation, CEL rules, the status and
# scale subresources and the Table (printer column) output of a real API server. What it is not: core
# resources (no /api), pods, controllers, authentication (every request is allowed).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${AGENTGYM_CRD_CACHE:-$HOME/.cache/agentgym-crd}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BIN=$CACHE/bin
PACKAGES=golang-go,golang-k8s-apiextensions-apiserver-dev,etcd-server,ca-certificates

log() { printf '[build-crd-server] %s\n' "$*" >&2; }

if [ "${1:-}" = "--path" ]; then
  echo "$BIN"
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "usage: bash scripts/build-crd-server.sh [--path]" >&2
  exit 2
fi

if [ -x "$BIN/apiextensions-apiserver" ] && [ -x "$BIN/etcd" ]; then
  log "cached: $BIN"
  echo "$BIN"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  log "needs root and apt (mmdebstrap makes a Debian sid root to build in)"
  exit 2
fi
command -v mmdebstrap >/dev/null 2>&1 || {
  log "installing mmdebstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q mmdebstrap >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q mmdebstrap >/dev/null; }
}

mkdir -p "$CACHE" "$BIN"
ROOT=$CACHE/sid-root
start=$(date +%s)
if [ ! -x "$ROOT/usr/bin/go" ]; then
  rm -rf "$ROOT"
  log "making a Debian sid root with $PACKAGES"
  # Valid-Until off: a mirror snapshot may be older than sid's one-week Release validity.
  mmdebstrap --variant=apt --include="$PACKAGES" --aptopt='Acquire::Check-Valid-Until "false"' sid "$ROOT" "$MIRROR" >"$CACHE/mmdebstrap.log" 2>&1 \
    || { tail -n 30 "$CACHE/mmdebstrap.log" >&2; exit 1; }
  log "sid root in $(($(date +%s) - start)) s"
fi

# Go reads /proc/self/exe to find its GOROOT.
mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
trap 'umount "$ROOT/proc" 2>/dev/null || true' EXIT
built=$(date +%s)
log "building k8s.io/apiextensions-apiserver with $(chroot "$ROOT" go version)"
# GOPATH mode over Debian's source tree, as Debian's own builds do; CGO off so the binary is static.
chroot "$ROOT" env GOPATH=/usr/share/gocode GO111MODULE=off CGO_ENABLED=0 GOCACHE=/tmp/go-cache GOFLAGS=-trimpath \
  HOME=/tmp go build -ldflags="-s -w" -o /tmp/apiextensions-apiserver k8s.io/apiextensions-apiserver \
  >"$CACHE/go-build.log" 2>&1 || { tail -n 40 "$CACHE/go-build.log" >&2; exit 1; }
log "built in $(($(date +%s) - built)) s"

install -m 0755 "$ROOT/tmp/apiextensions-apiserver" "$BIN/apiextensions-apiserver"
install -m 0755 "$ROOT/usr/bin/etcd" "$BIN/etcd"
chroot "$ROOT" dpkg-query -W -f='${Package} ${Version}\n' golang-k8s-apiextensions-apiserver-dev etcd-server \
  golang-go >"$BIN/VERSIONS"
if ! "$BIN/etcd" --version >/dev/null 2>&1; then
  log "sid's etcd does not run on this host: $("$BIN/etcd" --version 2>&1 | tail -n 1)"
  exit 1
fi
umount "$ROOT/proc"
[ "${AGENTGYM_CRD_KEEP_ROOT:-0}" = "1" ] || rm -rf "$ROOT"
log "$(cat "$BIN/VERSIONS" | tr '\n' ';') in $(($(date +%s) - start)) s"
echo "$BIN"
