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
    """The API server, its Kubernetes version and the operator Deployments (image, version
    label); `error` says why not when the cluster cannot be asked."""
    try:
        from kubernetes import client

        from .kubeaccess import api_message, connect

        kube = connect(args)
        out: dict[str, Any] = {"server": kube.api.configuration.host}
        out["kubernetes"] = client.VersionApi(kube.api).get_code(_request_timeout=QUICK).git_version
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
