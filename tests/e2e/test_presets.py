"""Every algorithm preset runs real steps against a real CPU rollout server."""

import json
import os
import subprocess
import sys

import pytest

from rlhf_operator.api import validate_job
from rlhf_operator.api.presets import PRESETS

from rlhf_operator.local import free_port

pytestmark = pytest.mark.slow


def job_config(preset: str, model_dir, out) -> dict:
    job = validate_job({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": f"preset-{preset.replace('_', '-')}"},
        "spec": {
            "model": {"path": str(model_dir)}, "data": {"path": "builtin://last-digit"},
            "algorithm": {"preset": preset, "numMiniBatches": 2, "tisCap": 2.0},
            "rollout": {"engine": "cpu", "samplesPerPrompt": 4, "maxTokens": 5},
            "trainer": {"learningRate": 1e-3, "microBatchSize": 4},
            "schedule": {"totalSteps": 2, "promptsPerStep": 4, "saveEvery": 2},
            "output": {"dir": str(out)},
        },
    })
    return job.to_config()


@pytest.fixture(scope="module")
def engine(start_engines, tiny_model_dir):
    with start_engines(tiny_model_dir, 1) as urls:
        yield urls[0]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_runs(preset, engine, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job_config(preset, tiny_model_dir, out)))
    env = {**os.environ, "RLHF_JOB_CONFIG": str(config), "RLHF_ROLLOUT_ENDPOINTS": engine,
           "RLHF_WEIGHT_SYNC_ADDR": f"127.0.0.1:{free_port()}", "RLHF_OUTPUT_DIR": str(out),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = subprocess.run([sys.executable, "-m", "rlhf_trainer"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    p = PRESETS[preset]
    for r in rows:
        assert (r["kl"] is not None) == (p["kl_coef"] > 0)
        assert ("value_loss" in r) == p["critic"]
        assert 0 <= r["dropped_group_fraction"] <= 1
        if p["critic"]:
            assert r["value_loss"] >= 0 and "explained_variance" in r
        if p["overlong_buffer"]:  # the penalty shapes the reward but not the score
            assert r["reward_mean"] <= r["score_mean"]
    saved = json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert saved["policy_version"] == 2
    assert (out / "final" / "model.safetensors").exists()
