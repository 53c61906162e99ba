#!/usr/bin/env bash
# Builds versitygw (github.com/versity/versitygw, an S3-compatible server; its posix backend
# serves a directory) from the Go module beside this script, for the tests of the S3 paths
# (tests/*/test_*s3*.py start it on a free port). Prints the directory holding the binary:
#   ${RLHF_S3SERVER_BIN_CACHE:-~/.cache/rlhf-operator}/versitygw-<hash>/versitygw
# where <hash> covers go.mod, go.sum and this script (the way tests/cluster/build.sh keys
# the control plane; kept apart from it so a bump here never rebuilds the control plane).
#   tests/s3server/build.sh           build if needed, print the directory
#   tests/s3server/build.sh --print   print the directory only (built or not)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${RLHF_S3SERVER_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator}"
HASH="$(cd "$HERE" && cat build.sh go.mod go.sum | sha256sum | cut -c1-16)"
BIN_DIR="$CACHE_ROOT/versitygw-$HASH"

if [[ "${1:-}" == "--print" ]]; then
    echo "$BIN_DIR"
    exit 0
fi
if [[ -f "$BIN_DIR/.complete" ]]; then
    echo "$BIN_DIR"
    exit 0
fi
command -v go >/dev/null || { echo "s3server/build.sh: go is not on PATH (Go >= 1.24 needed)" >&2; exit 1; }

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.versitygw.lock"
flock 9
if [[ -f "$BIN_DIR/.complete" ]]; then
    echo "$BIN_DIR"
    exit 0
fi
TMP="$(mktemp -d "$CACHE_ROOT/.versitygw-build.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
start=$(date +%s)
export GOFLAGS="${GOFLAGS:-} -mod=readonly"
export CGO_ENABLED=0
echo "s3server/build.sh: building versitygw into $BIN_DIR" >&2
(cd "$HERE" && go build -ldflags "-s -w" -o "$TMP/" tool) >&2
[[ -x "$TMP/versitygw" ]] || { echo "s3server/build.sh: versitygw missing after build" >&2; exit 1; }
echo "$(( $(date +%s) - start ))" > "$TMP/.build-seconds"
touch "$TMP/.complete"
rm -rf "$BIN_DIR"
mv "$TMP" "$BIN_DIR"
trap - EXIT
# Older builds (another go.mod) are removed.
for old in "$CACHE_ROOT"/versitygw-*; do
    [[ "$old" == "$BIN_DIR" ]] || rm -rf "$old"
done
echo "s3server/build.sh: built in $(cat "$BIN_DIR/.build-seconds") s" >&2
echo "$BIN_DIR"
