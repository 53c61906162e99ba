#!/usr/bin/env bash
# Builds the Kubeflow Trainer v2 controller for the cluster tests of `spec.backend: TrainJob`
# and copies its CRDs, RBAC, webhook and runtime manifests beside it; prints the directory.
#
#   tests/cluster/trainer/build.sh            build if needed, print the directory
#   tests/cluster/trainer/build.sh --print    print the directory only (built or not)
#
# Its own cache, apart from the control plane's (tests/cluster/build.sh) and Kueue's:
#   ${RLHF_TRAINER_BIN_CACHE:-~/.cache/rlhf-operator/trainer-bin}/<hash of this script>/
# `go install github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager@v2.3.0` builds it
# from the Go module proxy (about 70 s on 2 idle cores); the module carries
# manifests/base/{crds,rbac,webhook,runtimes}.
set -euo pipefail

TRAINER_VERSION=v2.3.0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${RLHF_TRAINER_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator/trainer-bin}"
DIR="$CACHE_ROOT/$(sha256sum "$HERE/build.sh" | cut -c1-16)"

if [[ "${1:-}" == "--print" ]]; then
    echo "$DIR"
    exit 0
fi
if [[ -f "$DIR/.complete" ]]; then
    echo "$DIR"
    exit 0
fi
command -v go >/dev/null || { echo "trainer/build.sh: go is not on PATH" >&2; exit 1; }
mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -f "$DIR/.complete" ]]; then
    echo "$DIR"
    exit 0
fi
rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp"
GOBIN="$DIR.tmp" go install "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager@$TRAINER_VERSION" >&2
SRC="$(go env GOMODCACHE)/github.com/kubeflow/trainer/v2@$TRAINER_VERSION/manifests/base"
for part in crds rbac webhook runtimes; do
    mkdir -p "$DIR.tmp/$part"
    cp -r "$SRC/$part/." "$DIR.tmp/$part/"
done
chmod -R u+w "$DIR.tmp"
touch "$DIR.tmp/.complete"
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
echo "$DIR"
