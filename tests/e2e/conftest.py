"""Shared by the end-to-end tests: one CPU rollout server and a way to run a trainer
process (`python -m rlhf_trainer`, world of one) against it with a job config."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_contract.api import RLHFJob
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_launcher.local import free_port


@pytest.fixture(scope="session")
def engine(start_engines, tiny_model_dir):
    with start_engines(tiny_model_dir, 1, "--enable-sleep-mode") as urls:  # colocated runs use it too
        yield urls[0]


@pytest.fixture
def run_trainer(engine, tmp_path):
    """Run one trainer process with `config`; return its metrics rows."""

    def run(config: dict, timeout: float = 300, expect_failure: bool = False):
        """The run's metrics rows; with `expect_failure`, its CompletedProcess (it must fail)."""
        out = Path(config["spec"]["output"]["dir"])
        path = tmp_path / "trainer.json"
        path.write_text(TrainerConfig.from_job(RLHFJob.model_validate(config)).to_json())
        env = {**os.environ, "RLHF_TRAINER_CONFIG": str(path), "RLHF_ROLLOUT_ENDPOINTS": engine,
               "RLHF_WEIGHT_SYNC_ADDR": f"127.0.0.1:{free_port()}", "RLHF_OUTPUT_DIR": str(out),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        res = subprocess.run([sys.executable, "-m", "rlhf_trainer"], env=env, capture_output=True, text=True,
                             timeout=timeout)
        if expect_failure:
            assert res.returncode != 0, res.stderr[-4000:]
            return res
        assert res.returncode == 0, res.stderr[-4000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    return run
