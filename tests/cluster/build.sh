#!/usr/bin/env bash
# Builds the test control plane's binaries from the Go modules under tests/cluster/tools/
# and prints the directory that holds them.
#
#   tests/cluster/build.sh            build if needed, print the bin directory
#   tests/cluster/build.sh --print    print the bin directory only (built or not)
#
# The binaries land in a cache outside the repository,
#   ${RLHF_CLUSTER_BIN_CACHE:-~/.cache/rlhf-operator/cluster-bin}/<hash>/
# where <hash> covers every go.mod / go.sum under tools/ and this script, so a second
# run (or a fresh clone on the same machine) finds them and builds nothing. Go's own
# module and build caches (GOMODCACHE, GOCACHE) keep their defaults, also outside the
# repository, so a rebuild after a version bump recompiles only what changed.
#
# Each module under tools/ pins its binaries with `tool` directives; all of a module's
# tools are built by ONE `go build` so shared packages compile once. Modules:
#   k8s/               kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
#                      (k8s.io/kubernetes v1.34.4, staging modules replaced by v0.34.4),
#                      kubelet and kube-proxy (the real node of tests/cluster/node/),
#                      etcd (go.etcd.io/etcd/server/v3, the v3.6 that kubernetes pins), helm v3
#   kwok/              kwok v0.8 (built against k8s.io/* v0.36; v0.7 does not compile with v0.34), the
#                      JobSet controller v0.12 (sigs.k8s.io/jobset) and Kubeflow Trainer v2.3's
#                      controller (spec.backend TrainJob), all on k8s.io/* v0.36 and controller-runtime
#                      v0.24: one module, so client-go and friends compile once for the three. Trainer
#                      and its manifests land in trainer/ (tests/cluster/trainer/build.sh prints it).
#   training-operator/ Kubeflow training-operator v1.9 (needs k8s.io/* v0.31 and
#                      controller-runtime v0.19)
# The three cannot share one module: each pins k8s.io/* versions the others do not compile with.
# Kueue (tests/cluster/kueue/build.sh) stays apart too: v0.17 pins k8s.io/* v0.35 and
# controller-runtime v0.23.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOLS="$HERE/tools"
CACHE_ROOT="${RLHF_CLUSTER_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator/cluster-bin}"

KUBE_VERSION=v1.34.4
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy kwok helm training-operator jobset
          trainer/trainer-controller-manager)

hash_inputs() {
    (cd "$HERE" && cat build.sh tools/*/go.mod tools/*/go.sum) | sha256sum | cut -c1-16
}

BIN_DIR="$CACHE_ROOT/$(hash_inputs)"

if [[ "${1:-}" == "--print" ]]; then
    echo "$BIN_DIR"
    exit 0
fi

if [[ -f "$BIN_DIR/.complete" ]]; then
    touch "$BIN_DIR/.complete"   # most recently used: kept by the pruning below
    echo "$BIN_DIR"
    exit 0
fi

command -v go >/dev/null || { echo "build.sh: go is not on PATH (Go >= 1.24 needed)" >&2; exit 1; }

mkdir -p "$CACHE_ROOT"
# One builder at a time (two pytest sessions, or make cluster beside pytest).
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -f "$BIN_DIR/.complete" ]]; then
    echo "$BIN_DIR"
    exit 0
fi

TMP="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
start=$(date +%s)

# Keep the user's GOFLAGS but make sure nothing writes into the repository.
export GOFLAGS="${GOFLAGS:-} -mod=readonly"
export CGO_ENABLED=0

minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    kube_ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

echo "build.sh: building the test control plane into $BIN_DIR (a cold build takes many minutes)" >&2

mkdir -p "$TMP/k8s" "$TMP/kwok" "$TMP/training-operator"
# One module after the other: on 2 cores, building the three side by side was slower
# (cold: 11m57s against 11m10s), so each `go build` gets both cores.
(cd "$TOOLS/k8s" && go build -ldflags "$kube_ldflags" -o "$TMP/k8s/" tool) >&2
(cd "$TOOLS/kwok" && go build -ldflags "-s -w" -o "$TMP/kwok/" tool) >&2
(cd "$TOOLS/training-operator" && go build -ldflags "-s -w" -o "$TMP/training-operator/" tool) >&2

out="$TMP/out"
mkdir -p "$out"
# `go build` names a binary after the last path element that is not a major version
# suffix: go.etcd.io/etcd/server/v3 -> "server".
mv "$TMP/k8s/server" "$out/etcd"
mv "$TMP/kwok/kwok" "$out/kwok"
mv "$TMP/kwok/jobset" "$out/jobset"
mkdir -p "$out/trainer"
mv "$TMP/kwok/trainer-controller-manager" "$out/trainer/"
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy helm; do
    mv "$TMP/k8s/$b" "$out/$b"
done
mv "$TMP/training-operator/training-operator.v1" "$out/training-operator"

# Manifests the harness applies, copied from the module cache so that running the
# cluster never needs the module cache.
to_dir="$(cd "$TOOLS/training-operator" && go list -m -f '{{.Dir}}' github.com/kubeflow/training-operator)"
mkdir -p "$out/manifests"
cp "$to_dir/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" "$out/manifests/"
# kwok's own stage definitions (pod ready/complete/delete, node initialize/heartbeat and
# its chaos stages); the harness adds its own stages beside them.
kwok_dir="$(cd "$TOOLS/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
mkdir -p "$out/manifests/kwok-stages"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         node/chaos/node-not-ready.yaml pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml \
         pod/fast/pod-delete.yaml pod/chaos/pod-container-running-failed.yaml; do
    cp "$kwok_dir/kustomize/stage/$f" "$out/manifests/kwok-stages/"
done
# JobSet's CRD and its webhook configurations (the harness points them at 127.0.0.1).
js_dir="$(cd "$TOOLS/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/jobset)"
mkdir -p "$out/manifests/jobset"
cp "$js_dir/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml" "$js_dir/config/components/webhook/manifests.yaml" \
   "$out/manifests/jobset/"
# Kubeflow Trainer v2's CRDs, RBAC, webhooks and runtimes beside its binary.
tr_dir="$(cd "$TOOLS/kwok" && go list -m -f '{{.Dir}}' github.com/kubeflow/trainer/v2)"
for part in crds rbac webhook runtimes; do
    mkdir -p "$out/trainer/$part"
    cp -r "$tr_dir/manifests/base/$part/." "$out/trainer/$part/"
done
touch "$out/trainer/.complete"
chmod -R u+w "$out/manifests" "$out/trainer"

for b in "${BINARIES[@]}"; do
    [[ -x "$out/$b" ]] || { echo "build.sh: $b missing after build" >&2; exit 1; }
done
echo "$(( $(date +%s) - start ))" > "$out/.build-seconds"
touch "$out/.complete"

rm -rf "$BIN_DIR"
mv "$out" "$BIN_DIR"
# Keep the three most recently used builds (other branches may pin other versions).
for old in $(ls -1dt "$CACHE_ROOT"/*/.complete 2>/dev/null | tail -n +4); do
    rm -rf "$(dirname "$old")"
done
echo "build.sh: built in $(cat "$BIN_DIR/.build-seconds") s" >&2
echo "$BIN_DIR"
