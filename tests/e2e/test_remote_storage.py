"""Done-when of `hf://` / `s3://` (issue 36), end to end with real servers: a local run
reads its model from a Hub-protocol server (olah) and its prompts from an S3 server
(versitygw), writes its checkpoints and `final/` to the bucket, is resumed from the bucket
after its output directory is deleted, and the bucket's `final/` loads with transformers.
The bucket is reached through a proxy that slows every checkpoint object down: step 2 trains
while step 1's checkpoint goes up, and COMPLETE is sent only after the files it lists.
`output.hub.every: 1` pushes a model transformers loads at the tag `step-1` (and `final/` as
`main`) through the Hub's write routes in front of olah."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

DELAY_S = 1.0
"""Added by the proxy to each PUT of a checkpoint object."""


@pytest.fixture
def slow_s3(s3_server):
    """(endpoint, PUTs as (key, start, end)) of a proxy in front of versitygw adding DELAY_S to
    each checkpoint object's PUT."""
    from storage_servers import Served, forward

    puts = []

    def answer(handler, body):
        start = time.monotonic()
        if handler.command == "PUT" and "/checkpoints/" in handler.path:
            time.sleep(DELAY_S)
        answered = forward(s3_server.port, handler, body)
        if handler.command == "PUT":
            puts.append((handler.path.split("?")[0], start, time.monotonic()))
        return answered

    proxy = Served(answer)
    yield proxy.url, puts
    proxy.close()


@pytest.fixture
def hub_uploads(hub_server):
    from storage_servers import HubUploads

    shim = HubUploads(hub_server)
    yield shim
    shim.close()


def test_model_from_the_hub_data_from_s3_outputs_to_s3_resumed_from_the_bucket(
        hub_server, s3_server, slow_s3, hub_uploads, tiny_model_dir, tmp_path):
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
        "output": {"uri": "s3://e2e-runs/grpo", "hub": {"repo": "e2e/tuned", "every": 1}},
    })
    job["spec"]["rollout"].update({"replicas": 1, "samplesPerPrompt": 4})
    job["spec"]["schedule"].update({"totalSteps": 2, "saveEvery": 1, "promptsPerStep": 4})
    job["spec"]["trainer"]["maxTokensPerMicroBatch"] = 40
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    env = {**os.environ, **s3_server.env(AWS_ENDPOINT_URL=slow_s3[0]), "HF_ENDPOINT": hub_uploads.endpoint,
           "HF_TOKEN": "hf_e2e"}

    def rlhfctl(*args):
        res = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "run", str(path), "--output", str(out), *args],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        assert res.returncode == 0, res.stderr[-3000:] + (out / "logs" / "trainer.log").read_text()[-3000:]
        return res

    rlhfctl()
    assert (out / "sources/hf/models/e2e/tiny/v1/config.json").exists()
    # step 2 trained while step 1's checkpoint went up: that upload began before step 1's row
    # was logged (the save comes first) and ended after step 2's training was over (when the
    # save of step 2 began waiting for it)
    puts = slow_s3[1]
    log_text = (out / "logs" / "trainer.log").read_text()

    def logged_at(pattern):
        found = re.search(r"^(\S+ \S+) INFO \S+: " + pattern, log_text, re.M)
        assert found, pattern
        return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), found

    step1_logged, _ = logged_at(r"step 1/2 ")
    waited_logged, waited = logged_at(r"step 2: waited ([0-9.]+) s for the previous checkpoint's upload")
    uploaded, _ = logged_at(r"uploaded \S+/checkpoints/step-1 to s3://e2e-runs/grpo")
    training_over = waited_logged - float(waited.group(2))
    step2_s = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1]["step_seconds"]
    assert step1_logged + 0.8 * step2_s <= training_over < uploaded, (step1_logged, training_over, uploaded)
    for step in (1, 2):  # COMPLETE sent after every other file of its checkpoint was answered
        files = [(k, a, b) for k, a, b in puts if f"/checkpoints/step-{step}/" in k]
        marker = next(a for k, a, _ in files if k.endswith("/COMPLETE"))
        assert all(b <= marker for k, _, b in files if not k.endswith("/COMPLETE"))
    assert [m for _, m, _ in hub_uploads.commits] == ["rlhf-operator: step 1", "rlhf-operator: final model"]
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

    from huggingface_hub import snapshot_download

    tuned = {}
    assert [m for _, m, _ in hub_uploads.commits][2:] == ["rlhf-operator: final model"]  # step 2 was restored, not trained
    for revision in ("step-1", "main"):
        local = snapshot_download("e2e/tuned", revision=revision, endpoint=hub_uploads.endpoint,
                                  cache_dir=tmp_path / "hub-cache")
        assert not list(Path(local).rglob("*.distcp"))
        tuned[revision] = AutoModelForCausalLM.from_pretrained(local).state_dict()
        assert "base_model: e2e/tiny" in (Path(local) / "README.md").read_text()
    assert all(tuned["main"][k].equal(model.state_dict()[k]) for k in tuned["main"])
    assert any(not tuned["step-1"][k].equal(tuned["main"][k]) for k in tuned["main"])
