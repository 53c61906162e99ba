"""Network children: the rollout servers' headless Service, the weight-sync Service, and
a NetworkPolicy that lets only the job's own pods reach the job's pods.

Simplification: the NetworkPolicy admits all ports between the job's pods (NCCL picks
ephemeral ports, so a port list could not be complete) and nothing from outside; a
Prometheus scraping the trainer needs an extra policy of the cluster admin's.
"""

from __future__ import annotations

from typing import Any

from rlhf_contract import pod as contract
from rlhf_contract.api.models import RLHFJob
from .lws import leader_selector
from .meta import LABEL_JOB, LABEL_ROLE, ROLE_ROLLOUT, metadata, network_policy_name, rollout_name, weight_sync_name


def build_rollout_service(job: RLHFJob) -> dict[str, Any]:
    name = rollout_name(job.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, name),
        "spec": {
            "clusterIP": "None",
            # DNS names exist from the start; the trainer's client waits for /health itself.
            "publishNotReadyAddresses": True,
            # LeaderWorkerSet groups: their leaders (vLLM's rank 0, the HTTP server) only
            "selector": {LABEL_JOB: job.metadata.name, LABEL_ROLE: ROLE_ROLLOUT, **leader_selector(job)},
            "ports": [{"name": "http", "port": contract.ROLLOUT_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_weight_sync_service(job: RLHFJob, rank0: dict[str, str]) -> dict[str, Any]:
    """Selects trainer rank 0 (`rank0`: its backend's selector, e.g. the PyTorchJob's master pod),
    where the weight-sync rendezvous (TCPStore) listens; headless, so NCCL peers see the
    pod address."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, weight_sync_name(job.metadata.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": rank0,
            "ports": [{"name": "weight-sync", "port": contract.WEIGHT_SYNC_PORT,
                       "targetPort": contract.WEIGHT_SYNC_PORT, "protocol": "TCP"}],
        },
    }


def build_network_policy(job: RLHFJob) -> dict[str, Any]:
    own = {"matchLabels": {LABEL_JOB: job.metadata.name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, network_policy_name(job.metadata.name)),
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": own}]}]},
    }
