#!/usr/bin/env bash
# Builds (or finds) what the real test node and the image builds need, in a cache outside
# the repository keyed by this script and the pause program:
#
#   ${RLHF_NODE_CACHE:-~/.cache/rlhf-operator/node-tools}/<hash>/
#     debs/      Debian bookworm packages unpacked with `dpkg -x` (no install, no apt state
#                changed): containerd, runc, the CNI plugins, iptables (nft backend) and
#                their libraries, conntrack, debootstrap
#     bin/       buildkitd + buildctl (BuildKit), registry (distribution), coredns, pause,
#                all from the Go module proxy; iptables wrappers that run the unpacked ones
#
#   tests/cluster/node/build.sh           build if needed, print the directory
#   tests/cluster/node/build.sh --print   print the directory only
#
# The kubelet and kube-proxy come from the control plane's own module (tests/cluster/build.sh).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${RLHF_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator/node-tools}"

BUILDKIT_VERSION=v0.34.2
DISTRIBUTION_VERSION=v3.1.2
COREDNS_VERSION=v1.15.0
# Debian bookworm's current builds (apt-get download takes the archive's version; the
# versions checked here are in ../../../docs/testing.md).
DEBS=(containerd runc containernetworking-plugins iptables libip4tc2 libip6tc2 libxtables12 libnftnl11
      libnfnetlink0 libnetfilter-conntrack3 libmnl0 conntrack libnetfilter-cthelper0 libnetfilter-queue1
      debootstrap)

hash_inputs() { (cd "$HERE" && cat build.sh pause/main.go pause/go.mod) | sha256sum | cut -c1-16; }
DIR="$CACHE_ROOT/$(hash_inputs)"
if [[ "${1:-}" == "--print" ]]; then echo "$DIR"; exit 0; fi
if [[ -f "$DIR/.complete" ]]; then touch "$DIR/.complete"; echo "$DIR"; exit 0; fi

command -v go >/dev/null || { echo "node/build.sh: go is not on PATH" >&2; exit 1; }
mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -f "$DIR/.complete" ]]; then echo "$DIR"; exit 0; fi
TMP="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
start=$(date +%s)
echo "node/build.sh: building the node tools into $DIR" >&2

mkdir -p "$TMP/dl" "$TMP/out/debs" "$TMP/out/bin"
(cd "$TMP/dl" && { apt-get download -q "${DEBS[@]}" 2>/dev/null \
    || { apt-get update -q >/dev/null && apt-get download -q "${DEBS[@]}"; }; }) >&2
for d in "$TMP"/dl/*.deb; do dpkg -x "$d" "$TMP/out/debs"; done
ls "$TMP"/dl/*.deb | xargs -n1 basename > "$TMP/out/debs/VERSIONS"

export CGO_ENABLED=0
# Each built inside its own module (downloaded from the proxy, go.sum checked): BuildKit's
# go.mod has exclude directives, which `go install pkg@version` refuses.
build_in_module() {  # module version out-dir packages...
    local mod="$1" ver="$2" out="$3"; shift 3
    local dir; dir="$(go mod download -json "$mod@$ver" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    (cd "$dir" && GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" -o "$out/" "$@") >&2
}
build_in_module github.com/moby/buildkit "$BUILDKIT_VERSION" "$TMP/out/bin" ./cmd/buildkitd ./cmd/buildctl
build_in_module github.com/distribution/distribution/v3 "$DISTRIBUTION_VERSION" "$TMP/out/bin" ./cmd/registry
build_in_module github.com/coredns/coredns "$COREDNS_VERSION" "$TMP/out/bin" .
(cd "$HERE/pause" && GOFLAGS=-mod=readonly go build -ldflags "-s -w" -o "$TMP/out/bin/pause" .) >&2

# iptables as kube-proxy and the CNI plugins call it: the unpacked nft build with its
# libraries and extensions (every name is one binary, xtables-nft-multi).
D="$CACHE_ROOT/$(hash_inputs)/debs"
for name in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    cat > "$TMP/out/bin/$name" <<WRAP
#!/bin/bash
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export XTABLES_LIBDIR="$D/usr/lib/x86_64-linux-gnu/xtables"
exec "$D/usr/sbin/xtables-nft-multi" "$name" "\$@"
WRAP
    chmod +x "$TMP/out/bin/$name"
done
cat > "$TMP/out/bin/conntrack" <<WRAP
#!/bin/bash
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$D/usr/sbin/conntrack" "\$@"
WRAP
chmod +x "$TMP/out/bin/conntrack"

echo "$(( $(date +%s) - start ))" > "$TMP/out/.build-seconds"
touch "$TMP/out/.complete"
rm -rf "$DIR"; mv "$TMP/out" "$DIR"
for old in $(ls -1dt "$CACHE_ROOT"/*/.complete 2>/dev/null | tail -n +3); do rm -rf "$(dirname "$old")"; done
echo "node/build.sh: built in $(cat "$DIR/.build-seconds") s" >&2
echo "$DIR"
