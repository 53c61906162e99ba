"""`rlhfctl env` (what a bug report needs: versions here and of the operator on the cluster)
and `rlhfctl completion bash|zsh` (argcomplete's own shell code; `rlhfctl` completes itself
when the shell calls it with `_ARGCOMPLETE` set, see cli.main)."""

from __future__ import annotations

import argparse
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from rlhf_contract.exit_codes import ExitCode

from .kubeaccess import add_cluster_args
from .output import add_output_arg, emit

PACKAGES = ("rlhf-operator", "torch", "transformers", "vllm", "deepspeed", "peft", "kubernetes", "kopf", "pydantic")
OPERATOR_SELECTOR = "app.kubernetes.io/part-of=rlhf-operator,app.kubernetes.io/component=operator"
"""The chart's labels of the operator Deployment (charts/rlhf-operator/templates/_helpers.tpl)."""
VERSION_LABEL = "app.kubernetes.io/version"
QUICK = (3, 5)  # connect, read seconds: `env` reports an unreachable cluster, it does not wait for it


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _cuda() -> dict[str, Any]:
    try:
        import torch
    except (ImportError, OSError) as err:  # not installed, or its CUDA libraries do not load
        return {"torch": f"cannot import: {err}"}
    out: dict[str, Any] = {"built_with": torch.version.cuda, "available": torch.cuda.is_available()}
    if out["available"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def cluster_report(args: argparse.Namespace) -> dict[str, Any]:
    """The API server, its Kubernetes version, the backends it has (`spec.backend`'s CRDs
    served, and Kueue) and the operator Deployments (image, version label); `error` says
    why not when the cluster cannot be asked."""
    try:
        from kubernetes import client

        from .kubeaccess import api_message, connect

        kube = connect(args)
        out: dict[str, Any] = {"server": kube.api.configuration.host}
        out["kubernetes"] = client.VersionApi(kube.api).get_code(_request_timeout=QUICK).git_version
        try:
            out["backends"] = {name: "installed" if have else "not installed"
                               for name, have in kube.backends(QUICK).items()}
        except client.ApiException as err:
            out["backends"] = f"cannot read the API groups: {api_message(err)}"
        try:
            found = kube.apps.list_deployment_for_all_namespaces(label_selector=OPERATOR_SELECTOR,
                                                                  _request_timeout=QUICK).items
        except client.ApiException as err:
            out["operator"] = f"cannot list Deployments in every namespace: {api_message(err)}"
            return out
        out["operator"] = [{"namespace": d.metadata.namespace, "name": d.metadata.name,
                            "version": (d.metadata.labels or {}).get(VERSION_LABEL),
                            "image": d.spec.template.spec.containers[0].image} for d in found] or "not installed"
        return out
    except Exception as err:  # any reason the cluster cannot be asked is part of the report
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}


def _cmd_env(args: argparse.Namespace) -> int:
    from rlhf_contract.images import INFERENCE_IMAGE, OPERATOR_IMAGE, TRAINER_IMAGE, VLLM_VERSION

    report = {
        "python": f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {name: _installed(name) or "not installed" for name in PACKAGES},
        "vllm_pin": VLLM_VERSION,
        "images": {"trainer": TRAINER_IMAGE, "inference": INFERENCE_IMAGE, "operator": OPERATOR_IMAGE},
        "cuda": _cuda(),
        "cluster": {"skipped": "--no-cluster"} if args.no_cluster else cluster_report(args),
    }
    if args.output_format:
        emit(report, args.output_format)
        return ExitCode.OK
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")
    return ExitCode.OK


def _cmd_completion(args: argparse.Namespace) -> int:
    import argcomplete

    sys.stdout.write(argcomplete.shellcode(["rlhfctl"], shell=args.shell))
    return ExitCode.OK


def add_support_commands(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser("env", help="print what a bug report needs: versions here, CUDA, the operator's version")
    env.add_argument("--no-cluster", action="store_true", help="do not ask the cluster")
    add_cluster_args(env, namespace=None)
    add_output_arg(env, "the report")
    env.set_defaults(func=_cmd_env)

    completion = sub.add_parser("completion", help="print the shell completion code, e.g. "
                                "`source <(rlhfctl completion bash)` (argcomplete)")
    completion.add_argument("shell", choices=["bash", "zsh"])
    completion.set_defaults(func=_cmd_completion)


def add_operator_commands(sub: argparse._SubParsersAction) -> None:
    """`rlhfctl operator` and `rlhfctl smoke-test` (the chart's `helm test`)."""
    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf) against the current kubeconfig")
    op.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable; default: all)")
    op.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (0: off)")
    op.add_argument("--lease-namespace", help="namespace of the leader Lease (default: $POD_NAMESPACE or the first --namespace)")
    op.add_argument("--lease-name", default="rlhf-operator",
                    help="name of the leader Lease (the chart gives each release its own)")
    op.add_argument("--lease-duration", type=int, default=15, help="seconds before another replica may take over")
    op.add_argument("--resync-seconds", type=float, default=15.0, help="reconcile every job at least this often")
    op.add_argument("--verbose", action="store_true")
    op.add_argument("--health-port", type=int, default=0,
                    help="serve /healthz (liveness: fails when the operator stops making progress) and /readyz (0: off)")
    op.add_argument("--log-format", choices=["text", "json"], default="text",
                    help="json: one object per line (time, level, logger, message)")

    def _cmd_operator(a: argparse.Namespace) -> int:
        from rlhf_operator.handlers import run as run_operator

        return run_operator(a.namespace, metrics_port=a.metrics_port, lease_namespace=a.lease_namespace,
                            lease_name=a.lease_name, lease_duration=a.lease_duration, resync_seconds=a.resync_seconds, verbose=a.verbose,
                            log_format=a.log_format, health_port=a.health_port)

    op.set_defaults(func=_cmd_operator)

    smoke = sub.add_parser("smoke-test", help="create a tiny suspended job, wait for its children, delete it "
                                              "(the chart's `helm test`)")
    smoke.add_argument("--namespace", required=True)
    smoke.add_argument("--name", default="rlhf-smoke-test")
    smoke.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the children")

    def _cmd_smoke(a: argparse.Namespace) -> int:
        from rlhf_operator.kube import Kube
        from rlhf_operator.smoke import run_smoke_test

        return run_smoke_test(Kube(), a.namespace, a.name, a.timeout)

    smoke.set_defaults(func=_cmd_smoke)
