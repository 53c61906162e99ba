#!/usr/bin/env bash
# Builds helm-unittest (the chart's unit tests, charts/rlhf-operator/tests/*_test.yaml)
# from the Go module pinned in charts/tools/helm-unittest/ and prints the directory that
# holds it. Like tests/cluster/build.sh: the binary lands in a cache outside the repository,
#   ${RLHF_CHART_TOOLS_CACHE:-~/.cache/rlhf-operator/chart-tools}/<hash>/
# where <hash> covers this script and the module's go.mod / go.sum.
#
#   charts/tools/build.sh            build if needed, print the bin directory
#   charts/tools/build.sh --print    print the bin directory only (built or not)
#
# helm-unittest's own go.mod replaces vmware-labs/yaml-jsonpath with its fork; a replace
# is not inherited by a module that requires it, so ours repeats it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${RLHF_CHART_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator/chart-tools}"
HASH="$(cd "$HERE" && cat build.sh helm-unittest/go.mod helm-unittest/go.sum | sha256sum | cut -c1-16)"
BIN_DIR="$CACHE_ROOT/$HASH"

if [[ "${1:-}" == "--print" ]]; then
    echo "$BIN_DIR"
    exit 0
fi
if [[ -f "$BIN_DIR/.complete" ]]; then
    echo "$BIN_DIR"
    exit 0
fi
command -v go >/dev/null || { echo "charts/tools/build.sh: go is not on PATH (Go >= 1.24 needed)" >&2; exit 1; }

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -f "$BIN_DIR/.complete" ]]; then
    echo "$BIN_DIR"
    exit 0
fi
TMP="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
export GOFLAGS="${GOFLAGS:-} -mod=readonly"
export CGO_ENABLED=0
echo "charts/tools/build.sh: building helm-unittest into $BIN_DIR" >&2
(cd "$HERE/helm-unittest" && go build -trimpath -ldflags="-s -w" -o "$TMP/" github.com/helm-unittest/helm-unittest/cmd/helm-unittest)
touch "$TMP/.complete"
rm -rf "$BIN_DIR"
mv "$TMP" "$BIN_DIR"
trap - EXIT
echo "$BIN_DIR"
