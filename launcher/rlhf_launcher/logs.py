"""`rlhfctl logs JOB`: the logs of a job's pods of one role, through the API server as
`kubectl logs` reads them. One pod prints as it is; several print each line prefixed with the
pod's name (`--follow` reads them all at once, one thread each).

- `--attempt N` (default: the newest, `rlhf.dev/attempt` or JobSet's restart-attempt label):
  the pods of that attempt while they exist. A restart deletes them; every trainer pod also
  keeps its log on the job's volume (`rlhf_contract.pod.trainer_log_path`). rlhfctl cannot
  mount a volume: it reads those files through a running trainer pod of the job (`kubectl
  exec`: `ls`, then `cat`, no shell); with none running, or exec refused, it says which file
  holds the log and how to read it.
- `--follow` goes on across restarts: when the newest attempt's pods give way to a newer
  attempt's, it prints `--- attempt N: ...` and follows those, until the job ends.
- `--previous`, `--since`, `--tail` as kubectl's (`--since`/`--tail` apply to the first
  attempt followed; a later one prints from its start).
- `--role fetch`: the download step (the `fetch` init container of the trainer and rollout
  pods)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rlhf_contract.exit_codes import ExitCode
from rlhf_contract.pod import trainer_log_path
from rlhf_contract.sandbox import LABEL_SANDBOX_OF
from rlhf_operator.builders.meta import LABEL_JOB, LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER, attempt_of
from rlhf_operator.builders.storage import FETCH_CONTAINER
from rlhf_operator.status import TERMINAL

from .kubeaccess import TIMEOUT, ClusterError, Kube, api_message, connect, namespace_of

FOLLOW_READ_S = 7 * 86400
"""A followed log may stay silent for long (the client takes no `None` for "no read limit")."""
POLL_S = 1.0
"""How often `--follow` looks for a newer attempt's pods."""
END_GRACE_S = 5.0
"""Once the job has ended, how long `--follow` lets its streams finish (a kubelet ends them
when the containers exit; a stream still open then is closed)."""
ROLES = ["trainer", "rollout", "sandbox", "fetch"]
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def since_seconds(text: str) -> int:
    """kubectl's `--since` (a Go duration: `30s`, `10m`, `1h30m`) in whole seconds, at least 1
    (the API server's `sinceSeconds` must be positive); `argparse` reports a ValueError."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"--since {text!r}: give a duration such as 30s, 10m or 1h30m")
    return max(1, math.ceil(sum(float(n) * _UNIT_S[u] for n, u in parts)))


def selector(job: str, role: str) -> str:
    """The pods of `role` (a sandbox pod is labelled apart from the job's: rlhf_contract.sandbox;
    the fetch step runs in the trainer and rollout pods)."""
    if role == "sandbox":
        return f"{LABEL_SANDBOX_OF}={job}"
    if role == "fetch":
        return f"{LABEL_JOB}={job},{LABEL_ROLE} in ({ROLE_TRAINER},{ROLE_ROLLOUT})"
    return f"{LABEL_JOB}={job},{LABEL_ROLE}={role}"


def attempt(pod: Any) -> int:
    """The pod's attempt (-1 when it carries none)."""
    found = attempt_of({"metadata": {"labels": pod.metadata.labels or {}}})
    return -1 if found is None else found


def container_of(pod: Any, role: str) -> str | None:
    """The container `role` reads in the pod: the fetch step's init container (None when the
    pod has none), else the pod's first container."""
    if role == "fetch":
        names = [c.name for c in pod.spec.init_containers or []]
        return FETCH_CONTAINER if FETCH_CONTAINER in names else None
    return pod.spec.containers[0].name


def of_attempt(pods: list[Any], wanted: int | None) -> list[Any]:
    """The pods of attempt `wanted` (None: the newest; all of them when none carries a label), by name."""
    if wanted is None:
        wanted = max((attempt(p) for p in pods), default=-1)
    return sorted((p for p in pods if attempt(p) == wanted), key=lambda p: p.metadata.name)


def newest_attempt(pods: list[Any]) -> list[Any]:
    return of_attempt(pods, None)


def started(pod: Any, container: str) -> bool:
    """Whether the container has a log to read (it runs or ran)."""
    statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
    state = next((s.state for s in statuses if s.name == container), None)
    return bool(state and (state.running or state.terminated))


@dataclass
class Reader:
    """The log streams of one attempt, printed through one lock."""

    kube: Kube
    namespace: str
    args: argparse.Namespace
    first: bool
    lock: threading.Lock = field(default_factory=threading.Lock)
    failures: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    responses: list[Any] = field(default_factory=list)
    stopping: bool = False

    def start(self, pod: Any, container: str, prefix: str) -> None:
        t = threading.Thread(target=self._stream, args=(pod.metadata.name, container, prefix), daemon=True)
        self.threads.append(t)
        t.start()

    def _stream(self, name: str, container: str, prefix: str) -> None:
        from kubernetes.client.rest import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        args = self.args
        limits = {"tail_lines": args.tail, "since_seconds": args.since} if self.first else {}
        try:
            resp = self.kube.core.read_namespaced_pod_log(
                name, self.namespace, container=container, follow=args.follow, previous=args.previous,
                _preload_content=False, _request_timeout=(TIMEOUT[0], FOLLOW_READ_S) if args.follow else TIMEOUT,
                **{k: v for k, v in limits.items() if v is not None})
            self.responses.append(resp)
            for line in iter_resp_lines(resp):  # each line as it arrives (the client's own splitting)
                with self.lock:
                    sys.stdout.write(f"{prefix}{line}\n")
                    sys.stdout.flush()
        except ApiException as err:
            self.failures.append(f"cannot read the log of pod {name}: {api_message(err)}")
        except Exception as err:  # the connection to the node's kubelet, through the API server
            if not self.stopping:
                self.failures.append(f"cannot read the log of pod {name}: {type(err).__name__}: {err}")

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def stop(self) -> None:
        """End every stream (a newer attempt has started)."""
        self.stopping = True
        for resp in self.responses:
            (getattr(resp, "shutdown", None) or resp.close)()
        for t in self.threads:
            t.join(timeout=10)


def _pods(kube: Kube, namespace: str, job: str, role: str) -> list[Any]:
    pods = kube.core.list_namespaced_pod(namespace, label_selector=selector(job, role), _request_timeout=TIMEOUT).items
    return [p for p in pods if container_of(p, role) is not None]


def kept_log_hint(job: dict[str, Any], wanted: int | str, pods: list[Any]) -> str:
    """Where attempt `wanted`'s trainer logs are kept on the job's volume, and how to read
    them from a trainer pod that mounts it now (`wanted` "<N>": of every attempt)."""
    path = trainer_log_path(_output_dir(job), wanted, "<pod>")
    running = [p.metadata.name for p in pods if p.status.phase == "Running"
               and (p.metadata.labels or {}).get(LABEL_ROLE) == ROLE_TRAINER]
    meta = job["metadata"]
    how = (f"; read them from a running trainer pod: kubectl exec -n {meta['namespace']} {running[0]} -- "
           f"sh -c 'cat {path.replace('<pod>', '*')}'" if running else
           "; read them from any pod that mounts the volume (e.g. kubectl exec into one), or from the volume itself")
    whose = "every attempt's trainer pods keep" if wanted == "<N>" else f"the trainer pods of attempt {wanted} keep"
    return f"{whose} their logs on the job's volume at {path}{how}"


def _exec(kube: Kube, namespace: str, pod: Any, command: list[str]) -> tuple[int, str, str]:
    """Run `command` in the pod's first container (`kubectl exec`): exit code, stdout, stderr."""
    from kubernetes.stream import stream
    from kubernetes.stream.ws_client import ERROR_CHANNEL

    ws = stream(kube.core.connect_get_namespaced_pod_exec, pod.metadata.name, namespace,
                container=pod.spec.containers[0].name, command=command, stdin=False, stdout=True, stderr=True,
                tty=False, _preload_content=False, _request_timeout=TIMEOUT)
    out, err = [], []
    while ws.is_open():
        ws.update(timeout=TIMEOUT[1])
        out.append(ws.read_stdout())
        err.append(ws.read_stderr())
    out.append(ws.read_stdout())
    err.append(ws.read_stderr())
    code, message = exit_status(ws.read_channel(ERROR_CHANNEL))
    return code, "".join(out), "".join(err) + message


def exit_status(raw: str) -> tuple[int, str]:
    """The command's exit code and the kubelet's message from exec's status channel (a
    metav1.Status: Success, or Failure with an ExitCode cause; a kubelet that gives no cause: 1)."""
    status = json.loads(raw) if raw else {}
    if status.get("status") == "Success":
        return 0, ""
    causes = (status.get("details") or {}).get("causes") or []
    code = next((c.get("message") for c in causes if c.get("reason") == "ExitCode"), None)
    return (int(code) if code and code.isdigit() else 1), status.get("message", "")


def read_kept(kube: Kube, job: dict[str, Any], args: argparse.Namespace, every: list[Any]) -> int:
    """An earlier attempt's trainer logs, read from the job's volume through a running trainer
    pod of the job (`ls`, then `cat` of each pod's file: no shell); where they are, and why they
    could not be read, when that fails."""
    from kubernetes.client.rest import ApiException

    namespace = job["metadata"]["namespace"]
    folder = trainer_log_path(_output_dir(job), args.attempt, "x").rsplit("/", 1)[0]
    running = [p for p in every if p.status.phase == "Running"]
    if not running:
        raise ClusterError(_no_pods(job, namespace, args, every))
    reader = running[0]
    try:
        code, listing, err = _exec(kube, namespace, reader, ["ls", "-1", folder])
        files = sorted(f for f in listing.split() if f.endswith(".log"))
        if code != 0 or not files:
            raise ClusterError(f"{_no_pods(job, namespace, args, every)} (none found there through pod "
                               f"{reader.metadata.name}: {err.strip() or f'{folder} holds no .log file'})")
        for name in files:
            code, text, err = _exec(kube, namespace, reader, ["cat", f"{folder}/{name}"])
            if code != 0:
                raise ClusterError(f"cannot read {folder}/{name} from pod {reader.metadata.name}: {err.strip()}")
            lines = text.splitlines()
            lines = lines[max(len(lines) - args.tail, 0):] if args.tail is not None else lines
            prefix = f"[{name.removesuffix('.log')}] " if len(files) > 1 else ""
            sys.stdout.write("".join(f"{prefix}{line}\n" for line in lines))
    except ClusterError:
        raise
    except Exception as err:  # exec refused (RBAC, no such pod) or its websocket failed: say where they are
        why = api_message(err) if isinstance(err, ApiException) else f"{type(err).__name__}: {err}"
        raise ClusterError(f"{_no_pods(job, namespace, args, every)} (reading them through pod "
                           f"{reader.metadata.name} failed: {why})") from None
    return ExitCode.OK


def _output_dir(job: dict[str, Any]) -> str:
    return ((job.get("spec") or {}).get("output") or {}).get("dir") or _default_output_dir()


def _default_output_dir() -> str:
    from rlhf_operator.builders.pods import DEFAULT_OUTPUT_DIR

    return DEFAULT_OUTPUT_DIR


def cmd_logs(args: argparse.Namespace) -> int:
    kube, namespace = connect(args), namespace_of(args)
    job = kube.job(namespace, args.name)
    if job is None:
        raise ClusterError(f"rlhfjob {args.name} not found in namespace {namespace}")
    every = _pods(kube, namespace, args.name, args.role)
    pods = of_attempt(every, args.attempt)
    if not pods and args.attempt is not None and args.role == "trainer" and not args.follow:
        return read_kept(kube, job, args, every)  # the pods are gone, their logs kept on the volume
    if not pods:
        raise ClusterError(_no_pods(job, namespace, args, every))
    if not args.follow:
        reader = Reader(kube, namespace, args, first=True)
        for p in pods:
            reader.start(p, container_of(p, args.role), f"[{p.metadata.name}] " if len(pods) > 1 else "")
            reader.threads[-1].join()  # one pod after the other
        return _report(reader.failures)
    try:
        return follow(kube, namespace, args, attempt(pods[0]))
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


def _no_pods(job: dict[str, Any], namespace: str, args: argparse.Namespace, every: list[Any]) -> str:
    what = "the fetch step (no trainer or rollout pod with a fetch container)" if args.role == "fetch" \
        else f"{args.role} pods"
    if args.attempt is None or not every:
        message = (f"rlhfjob {args.name} has no {what} in namespace {namespace} now "
                   f"(see its phase: rlhfctl get {args.name} -n {namespace})")
        if args.role == "trainer" and (job.get("status") or {}).get("startTime"):  # it ran: its logs are kept
            message += "; " + kept_log_hint(job, "<N>" if args.attempt is None else args.attempt, every)
        return message
    present = sorted({attempt(p) for p in every})
    message = (f"rlhfjob {args.name} has no {what} of attempt {args.attempt} now (its pods were deleted when the "
               f"job restarted; pods exist for attempt {', '.join(map(str, present))}: --attempt "
               f"{present[-1]})")
    if args.role == "trainer":
        message += "; " + kept_log_hint(job, args.attempt, every)
    return message


def _report(failures: list[str]) -> int:
    for line in failures:
        print(f"error: {line}", file=sys.stderr)
    return ExitCode.FAILED if failures else ExitCode.OK


def follow(kube: Kube, namespace: str, args: argparse.Namespace, current: int) -> int:
    """Follow attempt `current`'s pods, then each newer attempt's as it appears (a separator
    line between), until the job ends and its streams are done, or it is deleted."""
    reader, streaming, failures = Reader(kube, namespace, args, first=True), set(), []
    ended = None  # when the job was first seen ended (or gone)
    while True:
        pods = _pods(kube, namespace, args.name, args.role)
        newest = max((attempt(p) for p in pods), default=current)
        if newest > current:  # the job restarted: the old streams end, the new attempt's begin
            reader.stop()
            failures += reader.failures
            current, streaming = newest, set()
            reader = Reader(kube, namespace, args, first=False, lock=reader.lock)
            names = ", ".join(p.metadata.name for p in of_attempt(pods, current))
            with reader.lock:
                print(f"--- attempt {current}: {names} ---", flush=True)
        mine = of_attempt(pods, current)
        for p in mine:
            name, container = p.metadata.name, container_of(p, args.role)
            if name not in streaming and started(p, container):
                streaming.add(name)
                reader.start(p, container, f"[{name}] " if len(mine) > 1 else "")
        job = kube.job(namespace, args.name)
        if job is None or ((job.get("status") or {}).get("phase")) in TERMINAL:
            ended = ended or time.monotonic()
            if reader.done() or time.monotonic() - ended > END_GRACE_S:
                reader.stop()
                return _report(failures + reader.failures)
        time.sleep(POLL_S)
