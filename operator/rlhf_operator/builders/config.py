"""The ConfigMap `<job>-config`: the resolved job (presets applied) as JSON, mounted at
`/etc/rlhf/job.json` in every pod (RLHF_JOB_CONFIG)."""

from __future__ import annotations

import json
from typing import Any

from ..api.models import RLHFJob
from .meta import config_map_name, metadata
from .pods import CONFIG_FILE


def job_config(job: RLHFJob) -> dict[str, Any]:
    """The config the pods read: the resolved spec and a stable subset of the metadata
    (name, namespace, labels), so the ConfigMap changes only when the spec does."""
    config = job.to_config()
    config["metadata"] = {k: v for k, v in config["metadata"].items() if k in ("name", "namespace", "labels")}
    return config


def build_config_map(job: RLHFJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, config_map_name(job.metadata.name)),
        "data": {CONFIG_FILE: json.dumps(job_config(job), indent=1, sort_keys=True)},
    }
