"""How `rlhfctl submit / get / logs / delete / env` reach a cluster: the user's kubeconfig as
kubectl reads it (`--kubeconfig`, else `$KUBECONFIG`, which may list several files, else
~/.kube/config; `--context`, else the current context), and the namespace as kubectl picks
it (`--namespace`, else the context's, else `default`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

TIMEOUT = (5, 30)
"""Connect and read seconds of every request (a follow of a log has no read limit)."""
DEFAULT_NAMESPACE = "default"


class ClusterError(RuntimeError):
    """The cluster could not be reached or refused a request; the message says which and why."""


def add_cluster_args(p: argparse.ArgumentParser, namespace: str | None = "the context's, else default") -> None:
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    if namespace:
        p.add_argument("-n", "--namespace", help=f"namespace (default: {namespace})")


def _config_file(args: argparse.Namespace) -> str:
    return args.kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")


def context_namespace(args: argparse.Namespace) -> str | None:
    """The namespace of the kubeconfig context in use, if it names one (None also when
    there is no readable kubeconfig)."""
    from kubernetes import config

    try:
        contexts, current = config.list_kube_config_contexts(config_file=_config_file(args))
    except (config.ConfigException, OSError, TypeError, KeyError):
        return None
    ctx = next((c for c in contexts if c.get("name") == args.context), None) if args.context else current
    return ((ctx or {}).get("context") or {}).get("namespace")


@dataclass
class Kube:
    """The API clients of one kubeconfig context."""

    api: Any

    @property
    def core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api)

    @property
    def custom(self):
        from kubernetes import client

        return client.CustomObjectsApi(self.api)

    @property
    def apps(self):
        from kubernetes import client

        return client.AppsV1Api(self.api)

    def jobs(self, namespace: str | None, selector: str | None = None) -> list[dict[str, Any]]:
        """The jobs of a namespace (None: of every one), those whose labels match `selector` if given."""
        from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL

        more = {"label_selector": selector} if selector else {}
        if namespace is None:
            out = self.custom.list_cluster_custom_object(API_GROUP, API_VERSION, PLURAL, _request_timeout=TIMEOUT,
                                                         **more)
        else:
            out = self.custom.list_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL,
                                                            _request_timeout=TIMEOUT, **more)
        return out["items"]

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.rest import ApiException
        from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL

        try:
            return self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name,
                                                            _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status == 404:
                return None
            raise


    def backends(self, timeout: Any = TIMEOUT) -> dict[str, bool]:
        """Which backends (`spec.backend`) the cluster serves, and Kueue, by API discovery
        (rlhf_contract.backends.installed)."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException
        from rlhf_contract.backends import installed

        groups = {g.name for g in client.ApisApi(self.api).get_api_versions(_request_timeout=timeout).groups}

        def resources(group: str, version: str) -> set[str] | None:
            try:
                found = self.custom.get_api_resources(group, version, _request_timeout=timeout)
            except ApiException as err:
                if err.status == 404:  # the group is served, not this version
                    return None
                raise
            return {r.name for r in found.resources}

        return installed(groups, resources)


def connect(args: argparse.Namespace) -> Kube:
    from kubernetes import config

    try:
        api = config.new_client_from_config(config_file=_config_file(args), context=args.context,
                                            persist_config=False)
    except (config.ConfigException, OSError) as err:
        raise ClusterError(f"cannot use the kubeconfig {_config_file(args)}"
                           f"{f' (context {args.context})' if args.context else ''}: {err}; "
                           "pass --kubeconfig FILE / --context NAME or set KUBECONFIG") from None
    return Kube(api)


def namespace_of(args: argparse.Namespace) -> str:
    return args.namespace or context_namespace(args) or DEFAULT_NAMESPACE


def api_message(err: Exception) -> str:
    """The API server's own message of a failed request (its Status.message), else the error."""
    import json

    body = getattr(err, "body", None)
    try:
        status = json.loads(body) if body else None
    except (TypeError, ValueError):
        status = None
    if isinstance(status, dict) and status.get("message"):
        return f"{status['message']} ({getattr(err, 'status', '')} {status.get('reason', '')})".replace("( ", "(")
    reason = getattr(err, "reason", None)
    return f"{getattr(err, 'status', '')} {reason}" if reason else str(err)


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    """An owner reference to the job (not the controller: the operator's children have that)."""
    return {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": job["metadata"]["name"],
            "uid": job["metadata"]["uid"]}
