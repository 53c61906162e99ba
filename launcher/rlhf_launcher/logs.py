"""`rlhfctl logs JOB [--role trainer|rollout|sandbox] [--follow]`: the logs of a job's pods
of one role, from its newest attempt (`rlhf.dev/attempt`), through the API server as
`kubectl logs` reads them. One pod prints as it is; several print each line prefixed with
the pod's name (`--follow` reads them all at once, one thread each)."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from rlhf_contract.exit_codes import ExitCode
from rlhf_contract.sandbox import LABEL_SANDBOX_OF
from rlhf_operator.builders.meta import LABEL_ATTEMPT, LABEL_JOB, LABEL_ROLE

from .kubeaccess import TIMEOUT, ClusterError, Kube, api_message, connect, namespace_of

FOLLOW_READ_S = 7 * 86400
"""A followed log may stay silent for long (the client takes no `None` for "no read limit")."""


def selector(job: str, role: str) -> str:
    """The pods of `role` (a sandbox pod is labelled apart from the job's: rlhf_contract.sandbox)."""
    return f"{LABEL_SANDBOX_OF}={job}" if role == "sandbox" else f"{LABEL_JOB}={job},{LABEL_ROLE}={role}"


def newest_attempt(pods: list[Any]) -> list[Any]:
    """The pods of the newest attempt (all of them when none carries the label), by name."""
    def attempt(p) -> int:
        value = (p.metadata.labels or {}).get(LABEL_ATTEMPT, "")
        return int(value) if value.isdigit() else -1

    newest = max((attempt(p) for p in pods), default=-1)
    return sorted((p for p in pods if attempt(p) == newest), key=lambda p: p.metadata.name)


def _stream(kube: Kube, pod: Any, namespace: str, args: argparse.Namespace, prefix: str, lock: threading.Lock,
            failures: list[str]) -> None:
    from kubernetes.client.rest import ApiException
    from kubernetes.watch.watch import iter_resp_lines

    name = pod.metadata.name
    try:
        resp = kube.core.read_namespaced_pod_log(
            name, namespace, container=pod.spec.containers[0].name, follow=args.follow, tail_lines=args.tail,
            _preload_content=False, _request_timeout=(TIMEOUT[0], FOLLOW_READ_S) if args.follow else TIMEOUT)
        for line in iter_resp_lines(resp):  # each line as it arrives (the client's own splitting)
            with lock:
                sys.stdout.write(f"{prefix}{line}\n")
                sys.stdout.flush()
    except ApiException as err:
        failures.append(f"cannot read the log of pod {name}: {api_message(err)}")
    except Exception as err:  # the connection to the node's kubelet, through the API server
        failures.append(f"cannot read the log of pod {name}: {type(err).__name__}: {err}")


def cmd_logs(args: argparse.Namespace) -> int:
    kube, namespace = connect(args), namespace_of(args)
    if kube.job(namespace, args.name) is None:
        raise ClusterError(f"rlhfjob {args.name} not found in namespace {namespace}")
    pods = newest_attempt(kube.core.list_namespaced_pod(namespace, label_selector=selector(args.name, args.role),
                                                        _request_timeout=TIMEOUT).items)
    if not pods:
        raise ClusterError(f"rlhfjob {args.name} has no {args.role} pods in namespace {namespace} now "
                           f"(see its phase: rlhfctl get {args.name} -n {namespace})")
    lock, failures = threading.Lock(), []
    threads = [threading.Thread(target=_stream, daemon=True,
                                args=(kube, p, namespace, args, f"[{p.metadata.name}] " if len(pods) > 1 else "",
                                      lock, failures)) for p in pods]
    for t in threads:
        t.start()
        if not args.follow:
            t.join()  # one pod after the other
    for t in threads:
        t.join()
    for line in failures:
        print(f"error: {line}", file=sys.stderr)
    return ExitCode.FAILED if failures else ExitCode.OK
