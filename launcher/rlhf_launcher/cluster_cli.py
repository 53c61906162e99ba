"""`rlhfctl submit | get | logs | delete`: a job on a cluster, through the user's kubeconfig
(kubeaccess.py), as `kubectl` would do it but knowing the job.

`submit` validates the job as `validate` does, carries `--working-dir` in ConfigMaps
(workdir.py), refuses what the operator would refuse (its own `PodSettings` check) and a job
whose backend the cluster lacks (exit 2, naming the CRD and what installs it), creates
the ConfigMaps, then the job, then makes the job their owner (so they go with it). `--wait`
follows the phase and ends with the run's result: 0 Succeeded, the exit code the failed
pod's message names (2, 126, 127: permanent), else 1. A job with `metadata.generateName` and
no name is named by the API server (by `rlhfctl` with `--working-dir`: its ConfigMaps are
named after the job before it exists). `delete` takes several names, and
`--ignore-not-found`, as kubectl's. `get` is get.py, `logs` logs.py."""

from __future__ import annotations

import argparse
import copy
import functools
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rlhf_contract.exit_codes import ExitCode

from .kubeaccess import (
    DEFAULT_NAMESPACE, ClusterError, Kube, add_cluster_args, api_message, connect, context_namespace, namespace_of,
)
from .output import add_output_arg, dump_objects

_EXIT_IN_MESSAGE = re.compile(r"exited with code (\d+)")


def _cluster_command(fn: Callable[..., int]) -> Callable[..., int]:
    """Runs a command; a cluster that cannot be reached or refuses a request is exit 1 with
    the API server's message."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace, *more: Any) -> int:
        from kubernetes.client.rest import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(args, *more)
        except ClusterError as err:
            print(f"error: {err}", file=sys.stderr)
        except ApiException as err:
            print(f"error: the API server refused: {api_message(err)}", file=sys.stderr)
        except HTTPError as err:
            print(f"error: cannot reach the API server: {err}", file=sys.stderr)
        return ExitCode.FAILED

    return run


# ---- submit

def _prepare(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any], list[str], list[str]]:
    """The ConfigMaps and the job document to create, warnings, and the list of files sent;
    a `JobError`, `WorkdirError`, `PodSettingsError` or `ValueError` for a job that cannot go."""
    from rlhf_contract.api import job_source, read_job_document, validate_job
    from rlhf_operator.builders.pods import PodSettings
    from .workdir import Selection, left_behind, pack

    doc = read_job_document(args.job)
    job = validate_job(doc, args.set, job_source(args.job))  # `doc` now holds the overrides
    written = job.metadata.namespace
    if args.namespace and written and args.namespace != written:
        raise ValueError(f"metadata.namespace: {written!r} differs from --namespace {args.namespace}; "
                         "remove one of them")
    namespace = args.namespace or written or context_namespace(args) or DEFAULT_NAMESPACE
    config_maps: list[dict[str, Any]] = []
    sent: list[str] = []
    cwd = Path.cwd()
    if args.working_dir:
        if not (doc.get("metadata") or {}).get("name"):
            # its ConfigMaps are named after the job before it exists: the name is made here,
            # from metadata.generateName, as the API server would make it
            doc["metadata"] = {**{k: v for k, v in doc["metadata"].items() if k != "generateName"},
                               "name": job.metadata.name}
        packed = pack(doc, job, Path(args.working_dir), cwd, namespace,
                      Selection(tuple(args.exclude), tuple(args.include_secret)))
        doc, config_maps, sent = packed.doc, packed.config_maps, packed.listing(args.working_dir)
    elif args.exclude or args.include_secret:
        raise ValueError("--exclude and --include-secret choose files of --working-dir; pass --working-dir DIR")
    doc.setdefault("metadata", {})["namespace"] = namespace
    final = validate_job(copy.deepcopy(doc), (), job_source(args.job))
    PodSettings.from_job(final, allow_host_path=args.allow_host_path)  # what the operator refuses, refused here
    root = (cwd / args.working_dir).resolve() if args.working_dir else None
    return config_maps, doc, left_behind(job, cwd, root), sent


def _create(kube: Kube, config_maps: list[dict[str, Any]], doc: dict[str, Any]) -> dict[str, Any]:
    from kubernetes.client.rest import ApiException
    from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL
    from .kubeaccess import TIMEOUT, owner_reference

    ns, name = doc["metadata"]["namespace"], doc["metadata"].get("name")  # None: the server makes it (generateName)
    if name and kube.job(ns, name) is not None:
        raise ClusterError(f"rlhfjob {name} already exists in namespace {ns}: delete it first "
                           f"(rlhfctl delete {name} -n {ns}) or change metadata.name")
    made: list[str] = []
    try:
        for cm in config_maps:
            kube.core.create_namespaced_config_map(ns, cm, _request_timeout=TIMEOUT)
            made.append(cm["metadata"]["name"])
        created = kube.custom.create_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL, doc,
                                                              _request_timeout=TIMEOUT)
    except (ApiException, ClusterError):
        for cm_name in made:  # the job was not created: nothing would own them
            kube.core.delete_namespaced_config_map(cm_name, ns, _request_timeout=TIMEOUT)
        raise
    ref = owner_reference(created)
    for cm_name in made:
        kube.core.patch_namespaced_config_map(cm_name, ns, {"metadata": {"ownerReferences": [ref]}},
                                              _request_timeout=TIMEOUT)
    return created


def wait_until_done(kube: Kube, namespace: str, name: str, poll_s: float = 2.0) -> int:
    """Follow the job's phase and step (on stderr) until it ends; its result as an exit code.
    Ctrl-C stops waiting, not the job."""
    try:
        return _wait(kube, namespace, name, poll_s)
    except KeyboardInterrupt:
        print(f"stopped waiting; rlhfjob {name} goes on (rlhfctl get {name} -n {namespace})", file=sys.stderr)
        return ExitCode.INTERRUPTED


def _wait(kube: Kube, namespace: str, name: str, poll_s: float) -> int:
    seen = None
    while True:
        job = kube.job(namespace, name)
        if job is None:
            raise ClusterError(f"rlhfjob {name} was deleted in namespace {namespace} while waiting")
        status = job.get("status") or {}
        phase, step = status.get("phase", "Pending"), (status.get("progress") or {}).get("step", 0)
        if (phase, step) != seen:
            print(f"{name}: {phase}, step {step}" + (f": {status['message']}" if status.get("message") else ""),
                  file=sys.stderr)
            seen = (phase, step)
        if phase == "Succeeded":
            return ExitCode.OK
        if phase == "Failed":
            code = _EXIT_IN_MESSAGE.search(status.get("message", ""))
            return int(code.group(1)) if code and 0 < int(code.group(1)) < 256 else ExitCode.FAILED
        time.sleep(poll_s)


def _cmd_submit(args: argparse.Namespace) -> int:
    from rlhf_contract.api import JobError
    from rlhf_operator.builders.pods import PodSettingsError
    from .workdir import WorkdirError

    try:
        config_maps, doc, warnings, sent = _prepare(args)
    except JobError as err:
        print(err, file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    except (WorkdirError, PodSettingsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    for line in sent:  # on stderr: what goes, before it goes (stdout stays the objects)
        print(line, file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(dump_objects([*config_maps, doc], args.output_format or "yaml"))
        return ExitCode.OK
    return _submit(args, config_maps, doc)


def _backend_missing(kube: Kube, doc: dict[str, Any]) -> str | None:
    """Why the job cannot run here (its resolved backend's CRD is not served: what to
    install), or None; a cluster whose API groups cannot be read is let through (the
    operator's BackendMissing condition says it then)."""
    from kubernetes.client.rest import ApiException
    from rlhf_contract.api.models import resolve_backend
    from rlhf_contract.backends import missing_message

    backend = resolve_backend((doc.get("spec") or {}).get("backend"), doc["metadata"].get("labels") or {})
    try:
        have = kube.backends()
    except ApiException as err:
        print(f"warning: cannot tell which backends the cluster has: {api_message(err)}", file=sys.stderr)
        return None
    return None if have.get(backend, True) else missing_message(backend)


@_cluster_command
def _submit(args: argparse.Namespace, config_maps: list[dict[str, Any]], doc: dict[str, Any]) -> int:
    from kubernetes.client.rest import ApiException
    from .workdir import human

    kube = connect(args)
    if (missing := _backend_missing(kube, doc)) is not None:
        print(f"error: {missing}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    try:
        created = _create(kube, config_maps, doc)
    except ApiException as err:
        if err.status == 422:  # the CRD's schema or CEL rules refused it: an invalid job
            print(f"error: the API server refused the job: {api_message(err)}", file=sys.stderr)
            return ExitCode.CONFIG_ERROR
        raise
    ns, name = created["metadata"]["namespace"], created["metadata"]["name"]
    if args.output_format:
        sys.stdout.write(dump_objects([*config_maps, created], args.output_format))
    else:
        for cm in config_maps:
            files = {**cm.get("data", {}), **cm.get("binaryData", {})}
            print(f"configmap/{cm['metadata']['name']} created ({len(files)} files, "
                  f"{human(sum(len(v) for v in files.values()))}, owned by the job)")
        print(f"rlhfjob/{name} created in namespace {ns}")
    return wait_until_done(kube, ns, name) if args.wait else ExitCode.OK


# ---- get (get.py)

def _cmd_get(args: argparse.Namespace) -> int:
    from .get import cmd_get

    return cmd_get(args)


# ---- delete

@_cluster_command
def _cmd_delete(args: argparse.Namespace) -> int:
    """Each name in turn, as `kubectl delete rlhfjob a b c`: a name not found is an error line
    (none with --ignore-not-found) and the others are still deleted; exit 1 if any failed."""
    from kubernetes.client.rest import ApiException
    from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL
    from .kubeaccess import TIMEOUT

    kube, namespace = connect(args), namespace_of(args)
    code = ExitCode.OK
    for name in dict.fromkeys(args.names):  # each once, in the order given
        try:
            kube.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name,
                                                        propagation_policy="Background", _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status != 404:
                print(f"error: rlhfjob {name}: the API server refused: {api_message(err)}", file=sys.stderr)
                code = ExitCode.FAILED
            elif not args.ignore_not_found:
                print(f"error: rlhfjob {name} not found in namespace {namespace}", file=sys.stderr)
                code = ExitCode.FAILED
            continue
        print(f"rlhfjob/{name} deleted in namespace {namespace} (its pods, services and ConfigMaps go with it; "
              "checkpoints and logs stay on their volume)")
    return code


def _cmd_logs(args: argparse.Namespace) -> int:
    from .logs import cmd_logs

    return cmd_logs(args)


def add_cluster_commands(sub: argparse._SubParsersAction, add_job_args: Callable) -> None:
    submit = sub.add_parser("submit", help="create a job on the cluster, with the files of a working directory")
    add_job_args(submit)
    submit.add_argument("--working-dir", metavar="DIR", help="send the files under DIR in ConfigMaps owned by the "
                        "job (not .git, hidden entries, __pycache__, nor what .gitignore or .rlhfignore leave out); "
                        "the job's paths inside DIR are rewritten to where the pods mount them")
    submit.add_argument("--exclude", metavar="PATTERN", action="append", default=[],
                        help="leave out of --working-dir what PATTERN matches (.gitignore syntax, relative to DIR; "
                        "repeatable)")
    submit.add_argument("--include-secret", metavar="PATH", action="append", default=[],
                        help="send PATH (relative to DIR) although it looks like a credential (a key, a token, "
                        ".env, credentials); repeatable")
    submit.add_argument("--dry-run", action="store_true", help="print every object it would create, create none")
    submit.add_argument("--wait", action="store_true", help="follow the job until it ends; exit with its result")
    submit.add_argument("--allow-host-path", action="store_true", help="accept hostPath volumes in spec.pod (the "
                        "cluster's operator must be installed with security.allowHostPath; default: refused here)")
    add_cluster_args(submit, "metadata.namespace, else the context's, else default")
    add_output_arg(submit, "the objects created (with --dry-run: to be created; default YAML)")
    submit.set_defaults(func=_cmd_submit)

    get = sub.add_parser("get", help="the jobs of a namespace (a table), or one job's status and conditions")
    get.add_argument("name", nargs="?", help="a job's name (default: every job)")
    get.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    get.add_argument("-l", "--selector", metavar="SELECTOR", help="only the jobs whose labels match, as kubectl's "
                     "(key=value, key!=value, key in (a,b), key; comma-separated)")
    get.add_argument("-w", "--watch", action="store_true", help="after the table, a row each time a job changes; "
                     "a named job's watch ends when it does (0 Succeeded, 1 Failed), else at Ctrl-C")
    add_cluster_args(get)
    add_output_arg(get, "the job(s)")
    get.set_defaults(func=_cluster_command(_cmd_get))

    from .logs import ROLES, since_seconds

    logs = sub.add_parser("logs", help="the logs of a job's pods (its newest attempt, or --attempt N)")
    logs.add_argument("name", help="the job's name")
    logs.add_argument("--role", choices=ROLES, default="trainer",
                      help="whose logs (default: trainer; fetch: the download step of the trainer and rollout pods)")
    logs.add_argument("--attempt", type=int, metavar="N", help="the pods of restart attempt N (default: the newest); "
                      "once they are gone, where the trainer's log of that attempt is kept on the job's volume")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines, across restarts (a line "
                      "'--- attempt N: PODS ---' before each newer attempt), until the job ends")
    logs.add_argument("-p", "--previous", action="store_true",
                      help="the previous instance of each pod's container (after it restarted in place), as kubectl's")
    logs.add_argument("--since", type=since_seconds, metavar="DURATION",
                      help="only lines newer than DURATION (30s, 10m, 2h), as kubectl's")
    logs.add_argument("--tail", type=int, help="only the last N lines of each pod")
    add_cluster_args(logs)
    logs.set_defaults(func=_cluster_command(_cmd_logs))

    delete = sub.add_parser("delete", help="delete jobs; their children and working-directory ConfigMaps go with them")
    delete.add_argument("names", nargs="+", metavar="NAME", help="a job's name (several: each in turn)")
    delete.add_argument("--ignore-not-found", action="store_true",
                        help="a job that does not exist is no error (as kubectl's flag)")
    add_cluster_args(delete)
    delete.set_defaults(func=_cmd_delete)
