"""A real Kubernetes control plane for the tests, run as local processes; the command line
and the one import for tests. The parts:

    procs.py         binaries (tests/cluster/build.sh), waiting, stopping our own pids
    pki.py           certificates and the kubeconfig
    controlplane.py  `Cluster`: bring-up, attach, stop (etcd, kube-apiserver,
                     controller-manager, scheduler, kwok, training-operator)
    kwok.py          fake GPU nodes, node Leases, lost nodes, pod/node chaos stages
    client.py        kubectl, helm, server-side apply, the Python client

Command line (what `make cluster` / `make cluster-down` run):

    python tests/cluster/harness.py up [--nodes N] [--dir DIR]
    python tests/cluster/harness.py down [--dir DIR]
    python tests/cluster/harness.py status [--dir DIR]

Only the standard library and PyYAML are used here, so the module imports anywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the package `cluster` from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cluster.harness import main

    sys.exit(main())

from .controlplane import DEFAULT_DIR, KUBE_ORDER, REPO, Cluster  # noqa: E402
from .kwok import (  # noqa: E402
    COMPLETE_LABEL, FAIL_LABEL, GPU_RESOURCE, KWOK_NODE_ANNOTATION, NODE_LEASE_SECONDS, NOT_READY_LABEL,
)
from .procs import ClusterError, binaries_built, ensure_binaries, free_port, wait_for  # noqa: E402

__all__ = ["COMPLETE_LABEL", "DEFAULT_DIR", "FAIL_LABEL", "GPU_RESOURCE", "KUBE_ORDER", "KWOK_NODE_ANNOTATION",
           "NODE_LEASE_SECONDS", "NOT_READY_LABEL", "REPO", "Cluster", "ClusterError", "binaries_built",
           "ensure_binaries", "free_port", "wait_for"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status", "build"])
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="state directory (default: .cluster/)")
    ap.add_argument("--nodes", type=int, default=4, help="fake GPU nodes to create")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if args.command == "build":
        print(ensure_binaries())
        return 0
    if args.command == "down":
        c = Cluster.attach(root)
        if c is not None:
            c.stop()
        else:
            Cluster._kill_from_state(root)
        print(f"cluster in {root} stopped (logs kept in {root / 'logs'})")
        return 0
    if args.command == "status":
        c = Cluster.attach(root)
        if c is None:
            print(f"no cluster running in {root}")
            return 1
        print(f"running: {c.server}, kubeconfig {c.kubeconfig}")
        print(c.kubectl("get", "nodes").stdout)
        return 0
    bin_dir = ensure_binaries()
    c = Cluster(root, bin_dir=bin_dir).start(nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    print(f"cluster up in {c.started_in:.1f}s: {c.server}")
    print(f"  export KUBECONFIG={c.kubeconfig}")
    print(f"  export PATH={bin_dir}:$PATH   # kubectl, helm, kwok ...")
    print(f"  logs: {c.logs}/   stop: make cluster-down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
