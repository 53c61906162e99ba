"""The ConfigMap `<job>-config`: the trainer's config (`rlhf_contract.trainer_config`,
presets resolved) as JSON, mounted at `/etc/rlhf/trainer.json` in every pod
(RLHF_TRAINER_CONFIG), and beside it `job.json`, the resolved job spec the trackers log.
The rollout servers take everything from their command line."""

from __future__ import annotations

import json
from typing import Any

from rlhf_contract.api.models import RLHFJob
from rlhf_contract.pod import JOB_FILE, run_config
from rlhf_contract.sources import localize
from rlhf_contract.trainer_config import TrainerConfig

from .meta import config_map_name, metadata
from .pods import CONFIG_FILE, output_dir


def trainer_config(job: RLHFJob) -> TrainerConfig:
    """What the trainer pods read; it changes only when the spec (or the name) does. Its
    `hf://` / `s3://` paths are those of the copies the download step makes (storage.py)."""
    return TrainerConfig.from_job(localize(job, output_dir(job)))


def build_config_map(job: RLHFJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, config_map_name(job.metadata.name)),
        "data": {CONFIG_FILE: trainer_config(job).to_json(), JOB_FILE: json.dumps(run_config(job), indent=1)},
    }
