#!/usr/bin/env bash
# Prints the directory of the Kubeflow Trainer v2 controller for the cluster tests of
# `spec.backend: TrainJob`, with its CRDs, RBAC, webhook and runtime manifests beside it:
#
#   tests/cluster/trainer/build.sh            build if needed, print the directory
#   tests/cluster/trainer/build.sh --print    print the directory only (built or not)
#
# It is built with the control plane (tests/cluster/build.sh: the tool
# github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager@v2.3.0 in the module
# tools/kwok/, beside kwok and JobSet, so that client-go and controller-runtime compile once
# for the three) and lies in its cache, under trainer/.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
echo "$(bash "$HERE/../build.sh" "$@")/trainer"
