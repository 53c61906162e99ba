"""Done-when of `hf://` / `s3://` (issue 36), end to end with real servers: a local run
reads its model from a Hub-protocol server (olah) and its prompts from an S3 server
(versitygw), writes its checkpoints and `final/` to the bucket, is resumed from the bucket
after its output directory is deleted, and the bucket's `final/` loads with transformers."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_model_from_the_hub_data_from_s3_outputs_to_s3_resumed_from_the_bucket(
        hub_server, s3_server, tiny_model_dir, tmp_path):
    hub_server.add_repo("e2e/tiny", tiny_model_dir, tag="v1")
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{n}:", "answer": str(n)[-1]}) + "\n"
                                              for n in range(1000, 1064)))
    s3_server.put_dir("e2e-data", "lastdigit", data)
    s3_server.client().make_bucket("e2e-runs")
    job = yaml.safe_load((ROOT / "examples" / "local-grpo.yaml").read_text())
    job["spec"].update({
        "model": {"path": "hf://e2e/tiny@v1"},
        "data": {"path": "s3://e2e-data/lastdigit/train.jsonl", "maxPromptLength": 16},
        "output": {"uri": "s3://e2e-runs/grpo"},
    })
    job["spec"]["rollout"].update({"replicas": 1, "samplesPerPrompt": 4})
    job["spec"]["schedule"].update({"totalSteps": 2, "saveEvery": 1, "promptsPerStep": 4})
    job["spec"]["trainer"]["maxTokensPerMicroBatch"] = 40
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    env = {**os.environ, **s3_server.env(), "HF_ENDPOINT": hub_server.endpoint}

    def rlhfctl(*args):
        res = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "run", str(path), "--output", str(out), *args],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        assert res.returncode == 0, res.stderr[-3000:] + (out / "logs" / "trainer.log").read_text()[-3000:]
        return res

    rlhfctl()
    assert (out / "sources/hf/models/e2e/tiny/v1/config.json").exists()
    card = (out / "final" / "README.md").read_text()
    assert "base_model: e2e/tiny" in card and "hf://e2e/tiny@v1" in card and "exact_match" in card
    bucket = s3_server.client()
    names = {o.object_name for o in bucket.list_objects("e2e-runs", prefix="grpo/", recursive=True)}
    assert {"grpo/checkpoints/step-1/COMPLETE", "grpo/checkpoints/step-2/COMPLETE", "grpo/final/README.md",
            "grpo/final/config.json", "grpo/metrics.jsonl"} <= names

    shutil.rmtree(out)  # the volume is gone: the bucket has the run
    rlhfctl("--resume", "--set", "schedule.totalSteps=3")
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log and "step-2 (step 2)" in trainer_log
    assert "restored step-2" in (out / "logs" / "fetch.log").read_text()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # 1 and 2 from the bucket's metrics.jsonl, 3 trained now

    final = tmp_path / "bucket-final"
    for obj in bucket.list_objects("e2e-runs", prefix="grpo/final/", recursive=True):
        bucket.fget_object("e2e-runs", obj.object_name, str(final / obj.object_name.removeprefix("grpo/final/")))
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final)
    local = load_file(out / "final" / "model.safetensors")
    assert all(model.state_dict()[k].equal(v) for k, v in local.items())  # step 3's weights, not step 2's
    assert "| step | 3 |" in (final / "README.md").read_text()
