#!/usr/bin/env bash
# Builds the Kueue controller for the cluster tests (tests/cluster/test_kueue.py) and copies
# its CRDs and webhook manifests beside it; prints the directory.
#
#   tests/cluster/kueue/build.sh            build if needed, print the directory
#   tests/cluster/kueue/build.sh --print    print the directory only (built or not)
#
# Its own cache, apart from the control plane's (tests/cluster/build.sh, whose hash this
# never touches):  ${RLHF_KUEUE_BIN_CACHE:-~/.cache/rlhf-operator/kueue-bin}/<hash of this script>/
# `go install sigs.k8s.io/kueue/cmd/kueue@v0.17.0` builds it from the Go module proxy (about
# 2.5 minutes on 2 idle cores); the module carries config/components/{crd/bases,webhook}.
set -euo pipefail

KUEUE_VERSION=v0.17.0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${RLHF_KUEUE_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator/kueue-bin}"
DIR="$CACHE_ROOT/$(sha256sum "$HERE/build.sh" | cut -c1-16)"

if [[ "${1:-}" == "--print" ]]; then
    echo "$DIR"
    exit 0
fi
if [[ -f "$DIR/.complete" ]]; then
    echo "$DIR"
    exit 0
fi
command -v go >/dev/null || { echo "kueue/build.sh: go is not on PATH" >&2; exit 1; }
mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -f "$DIR/.complete" ]]; then
    echo "$DIR"
    exit 0
fi
rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp"
GOBIN="$DIR.tmp" go install "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION" >&2
SRC="$(go env GOMODCACHE)/sigs.k8s.io/kueue@$KUEUE_VERSION/config/components"
mkdir -p "$DIR.tmp/crd" "$DIR.tmp/webhook"
cp "$SRC"/crd/bases/*.yaml "$DIR.tmp/crd/"
cp "$SRC"/webhook/manifests.yaml "$DIR.tmp/webhook/"
touch "$DIR.tmp/.complete"
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
echo "$DIR"
