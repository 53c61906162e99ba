#!/usr/bin/env bash
# Builds the LeaderWorkerSet controller (sigs.k8s.io/lws) for the cluster tests of
# `rollout.nodesPerServer` > 1 and copies its CRD and webhook configurations beside it;
# prints the directory.
#
#   tests/cluster/lws/build.sh            build if needed, print the directory
#   tests/cluster/lws/build.sh --print    print the directory only (built or not)
#
# Its own cache, apart from the control plane's (tests/cluster/build.sh), Kueue's and Trainer's:
#   ${RLHF_LWS_BIN_CACHE:-~/.cache/rlhf-operator/lws-bin}/<hash of this script>/
# The manager (package sigs.k8s.io/lws/cmd) is built from the module v0.9.0 as the Go module
# proxy serves it (v0.9.0: the proxy this was built with refused v0.10.0's zip), named `lws-controller-manager` here; the module carries config/crd/bases and config/webhook/manifests.yaml.
set -euo pipefail

LWS_VERSION=v0.9.0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${RLHF_LWS_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator/lws-bin}"
DIR="$CACHE_ROOT/$(sha256sum "$HERE/build.sh" | cut -c1-16)"

if [[ "${1:-}" == "--print" ]]; then
    echo "$DIR"
    exit 0
fi
if [[ -f "$DIR/.complete" ]]; then
    echo "$DIR"
    exit 0
fi
command -v go >/dev/null || { echo "lws/build.sh: go is not on PATH" >&2; exit 1; }
mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -f "$DIR/.complete" ]]; then
    echo "$DIR"
    exit 0
fi
rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp"
# The module is downloaded, then built in place (`go install sigs.k8s.io/lws/cmd@...` would first
# ask the proxy for a module named sigs.k8s.io/lws/cmd, which some proxies refuse with 403).
(cd /tmp && go mod download "sigs.k8s.io/lws@$LWS_VERSION") >&2
MOD="$(go env GOMODCACHE)/sigs.k8s.io/lws@$LWS_VERSION"
(cd "$MOD" && CGO_ENABLED=0 go build -mod=readonly -ldflags "-s -w" -o "$DIR.tmp/lws-controller-manager" ./cmd) >&2
SRC="$MOD/config"
mkdir -p "$DIR.tmp/crds" "$DIR.tmp/webhook"
cp "$SRC/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$DIR.tmp/crds/"
cp "$SRC/webhook/manifests.yaml" "$DIR.tmp/webhook/"
chmod -R u+w "$DIR.tmp"
touch "$DIR.tmp/.complete"
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
echo "$DIR"
