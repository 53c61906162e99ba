"""`rlhfctl get [NAME] [-l SELECTOR] [-A] [-w] [-o json|yaml]`: the jobs of a namespace as a
table (kubectl's columns: NAME, PHASE, STEP, REWARD, RESTARTS, AGE), one job's status and
conditions, or with `-w` a row each time a job changes, as `kubectl get -w` prints them."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rlhf_contract.exit_codes import ExitCode
from rlhf_operator.status import TERMINAL

from .kubeaccess import ClusterError, Kube, connect, namespace_of
from .output import dump


def _age(timestamp: str | None) -> str:
    from datetime import datetime, timezone

    if not timestamp:
        return ""
    seconds = int((datetime.now(timezone.utc) - datetime.fromisoformat(timestamp.replace("Z", "+00:00")))
                  .total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _job_row(job: dict[str, Any], with_namespace: bool) -> list[str]:
    status = job.get("status") or {}
    progress = status.get("progress") or {}
    reward = progress.get("rewardMean")
    row = [job["metadata"]["name"], status.get("phase", ""),
           f"{progress.get('step', 0)}/{progress.get('totalSteps', 0)}" if progress.get("totalSteps") else "",
           f"{reward:.3f}" if isinstance(reward, (int, float)) else "", str(status.get("restarts", 0)),
           _age(job["metadata"].get("creationTimestamp"))]
    return ([job["metadata"].get("namespace", "")] if with_namespace else []) + row


def _print_job(job: dict[str, Any]) -> None:
    """One job's status, conditions and last reported metrics (status.progress)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    status = job.get("status") or {}
    meta = job["metadata"]
    console.print(f"[bold]{meta['name']}[/bold] in {meta.get('namespace')}: {status.get('phase', 'Pending')}, "
                  f"{status.get('restarts', 0)} restart(s), age {_age(meta.get('creationTimestamp'))}")
    if status.get("message"):
        console.print(f"message: {status['message']}", markup=False)
    for key in ("startTime", "completionTime"):
        if status.get(key):
            console.print(f"{key}: {status[key]}")
    progress = status.get("progress") or {}
    if progress:
        console.print("progress: " + ", ".join(f"{k} {v}" for k, v in progress.items()), markup=False)
    table = Table(title="conditions")
    for col in ("type", "status", "reason", "since", "message"):
        table.add_column(col, overflow="fold")
    for c in status.get("conditions", []):
        table.add_row(c.get("type", ""), c.get("status", ""), c.get("reason", ""),
                      _age(c.get("lastTransitionTime")), c.get("message", ""))
    console.print(table)


COLUMNS = ["NAME", "PHASE", "STEP", "REWARD", "RESTARTS", "AGE"]


def cmd_get(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.name and args.selector:
        print("error: a job's name and -l/--selector cannot go together (kubectl's rule): drop one of them",
              file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    kube = connect(args)
    namespace = None if args.all_namespaces else namespace_of(args)
    if args.watch:
        return watch_jobs(kube, namespace if not args.name else namespace_of(args), args)
    if args.name:
        job = kube.job(namespace_of(args), args.name)
        if job is None:
            print(f"error: rlhfjob {args.name} not found in namespace {namespace_of(args)}", file=sys.stderr)
            return ExitCode.FAILED
        if args.output_format:
            sys.stdout.write(dump(job, args.output_format))
        else:
            _print_job(job)
        return ExitCode.OK
    jobs = sorted(kube.jobs(namespace, args.selector),
                  key=lambda j: (j["metadata"].get("namespace", ""), j["metadata"]["name"]))
    if args.output_format:
        sys.stdout.write(dump({"apiVersion": "v1", "kind": "List", "items": jobs}, args.output_format))
        return ExitCode.OK
    if not jobs:
        where = "any namespace" if namespace is None else f"namespace {namespace}"
        print(f"no rlhfjobs in {where}" + (f" with labels {args.selector}" if args.selector else ""), file=sys.stderr)
        return ExitCode.OK
    table = Table(box=None, pad_edge=False)
    for col in (["NAMESPACE"] if namespace is None else []) + COLUMNS:
        table.add_column(col, overflow="fold")
    for job in jobs:
        table.add_row(*_job_row(job, namespace is None))
    Console(width=max(Console().width, 100)).print(table)
    return ExitCode.OK


def watch_line(row: list[str], widths: list[int]) -> str:
    """One row of `get -w`, in fixed columns (kubectl's: three spaces apart; a longer cell
    pushes the rest to the right rather than being cut)."""
    return "   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()


def watch_jobs(kube: Kube, namespace: str | None, args: argparse.Namespace) -> int:
    """`get -w`: the table's header, then a row each time a job's row changes (phase, step,
    reward, restarts; AGE alone does not count) or a job is deleted, as `kubectl get -w`
    (with `-o json|yaml`: the changed job, one JSON object or YAML document each).
    A named job's watch ends with it (0 Succeeded, 1 Failed or deleted); otherwise until Ctrl-C."""
    from kubernetes import watch
    from kubernetes.client.rest import ApiException
    from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL

    if args.name and kube.job(namespace_of(args), args.name) is None:
        raise ClusterError(f"rlhfjob {args.name} not found in namespace {namespace_of(args)}")
    header = (["NAMESPACE"] if namespace is None else []) + COLUMNS
    widths = [max(len(h), 9) for h in header]
    widths[header.index("NAME")] = 24
    if not args.output_format:
        print(watch_line(header, widths), flush=True)
    seen: dict[tuple[str, str], list[str]] = {}
    kwargs: dict[str, Any] = {"label_selector": args.selector or None}
    if args.name:
        kwargs["field_selector"] = f"metadata.name={args.name}"
    if namespace is None:
        list_fn, list_args = kube.custom.list_cluster_custom_object, (API_GROUP, API_VERSION, PLURAL)
    else:
        list_fn, list_args = kube.custom.list_namespaced_custom_object, (API_GROUP, API_VERSION, namespace, PLURAL)
    version = None
    try:
        while True:  # a watch request ends after timeout_seconds: start another from where it was
            stream = watch.Watch().stream(list_fn, *list_args, resource_version=version, timeout_seconds=60,
                                          **{k: v for k, v in kwargs.items() if v})
            try:
                for event in stream:
                    job = event["object"]
                    if event["type"] == "ERROR":
                        version = None  # 410 Gone: the version is too old; list afresh
                        break
                    version = job["metadata"].get("resourceVersion", version)
                    key = (job["metadata"].get("namespace", ""), job["metadata"]["name"])
                    row = _job_row(job, namespace is None)
                    if event["type"] == "DELETED":
                        row[header.index("PHASE")] = "Deleted"
                    if seen.get(key, [])[:-1] != row[:-1]:  # -o json|yaml: the changed object itself
                        shown = dump(job, args.output_format) if args.output_format else watch_line(row, widths) + "\n"
                        sys.stdout.write(("---\n" if args.output_format == "yaml" else "") + shown)
                        sys.stdout.flush()
                        seen[key] = row
                    if args.name and event["type"] == "DELETED":
                        print(f"error: rlhfjob {args.name} was deleted", file=sys.stderr)
                        return ExitCode.FAILED
                    phase = (job.get("status") or {}).get("phase")
                    if args.name and phase in TERMINAL:
                        return ExitCode.OK if phase == "Succeeded" else ExitCode.FAILED
            except ApiException as err:
                if err.status != 410:
                    raise
                version = None
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
