"""PURE builders: an RLHFJob (with its uid) -> the manifests (dicts) of its children.

No API calls here; kube.py applies what these return (server-side apply), reconcile.py
decides when. These are the parts every backend shares; what differs by backend (each
backend's workload, and `build_children`, the whole desired state of one attempt) is in
backends/.
"""

from __future__ import annotations

from .access import build_role, build_role_binding, build_service_account
from .config import build_config_map, trainer_config
from .judge import build_judge
from .meta import (
    LABEL_ATTEMPT, LABEL_JOB, LABEL_JOB_UID, LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER, config_map_name,
    network_policy_name, rollout_name, trainer_name, weight_sync_name,
)
from .pods import POD_SETTINGS_ANNOTATION, PodSettings, PodSettingsError
from .sandbox import build_sandbox, wants_sandbox
from .services import build_network_policy, build_rollout_service, build_weight_sync_service
from .workloads import build_rollout_statefulset, rollout_endpoints, weight_sync_addr

__all__ = [
    "LABEL_ATTEMPT", "LABEL_JOB", "LABEL_JOB_UID", "LABEL_ROLE", "POD_SETTINGS_ANNOTATION", "ROLE_ROLLOUT",
    "ROLE_TRAINER", "PodSettings", "PodSettingsError", "build_config_map", "build_judge", "build_network_policy",
    "build_role", "build_role_binding", "build_rollout_service", "build_rollout_statefulset", "build_sandbox",
    "build_service_account", "build_weight_sync_service", "config_map_name", "network_policy_name",
    "rollout_endpoints", "rollout_name", "trainer_config", "trainer_name", "wants_sandbox", "weight_sync_addr",
    "weight_sync_name",
]
