"""spec.tracking: what rank 0 hands TensorBoard, Weights & Biases (offline) and MLflow
(sqlite store), read back with each project's own reader: TensorBoard's EventAccumulator,
W&B's protobuf records (wandb.proto) of its offline run file, MLflow's client."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import pytest
import yaml

from rlhf_contract.api.models import RLHFJob, TrackingSpec
from rlhf_contract.pod import ENV_TRAINER_CONFIG, JOB_FILE, run_config
from rlhf_trainer.tracking import Trackers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-grpo.yaml"


def wandb_records(run_file: str):
    """The protobuf records of a W&B offline run file (`run-<id>.wandb`): a LevelDB-style log
    of 32 KiB blocks after a 7-byte `:W&B` header, each chunk under a 7-byte header (crc32,
    length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = Path(run_file).read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _rows(steps, scale):
    return [{"step": s, "reward_mean": s * scale, "eval/gsm/pass@4": 0.5, "kl": None, "note": "text"} for s in steps]


@pytest.fixture
def job_json(tmp_path, monkeypatch):
    """The job.json a trainer finds beside its config (as the operator and rlhfctl write it)."""
    job = RLHFJob.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / JOB_FILE).write_text(json.dumps(run_config(job)))
    monkeypatch.setenv(ENV_TRAINER_CONFIG, str(tmp_path / "config" / "trainer.json"))
    return run_config(job)


def _attempt(spec, out, steps, scale, resume_step=0):
    trackers = Trackers(spec, out, job_name="demo", resume_step=resume_step)
    for row in _rows(steps, scale):
        if trackers.samples_due(row["step"]):
            trackers.log_samples(row["step"], [{"step": row["step"], "prompt": f"what is {row['step']}|?",
                                                "completion": "line 1\nline 2", "reward": 1.0, "score": 0.5}])
        trackers.log(row["step"], row)
    trackers.close(success=True)
    return trackers


def test_three_trackers_log_every_key_config_samples_and_resume_without_duplicates(tmp_path, job_json):
    out = tmp_path / "out"
    spec = TrackingSpec.model_validate({"wandb": {"project": "rl", "mode": "offline", "tags": ["t1"]},
                                        "mlflow": {"trackingUri": f"sqlite:///{out}/mlflow.db", "experiment": "exp"},
                                        "samplesEvery": 2})
    first = _attempt(spec, out, [1, 2, 3], scale=0.1)  # step 3 was logged, then the run died
    second = _attempt(spec, out, [3, 4], scale=1.0, resume_step=2)  # resumed from the step-2 checkpoint
    assert first.state["wandb_run_id"] == second.state["wandb_run_id"]
    assert first.state["mlflow_run_id"] == second.state["mlflow_run_id"]

    # TensorBoard: the resumed attempt purged steps after 2, so step 3 is the re-run's value
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)]
    assert [e.step for e in events.Scalars("eval/gsm/pass@4")] == [1, 2, 3, 4]
    assert "kl" not in events.Tags()["scalars"] and "note" not in events.Tags()["scalars"]
    texts = {t: events.Tensors(t) for t in events.Tags()["tensors"]}
    assert any(t.startswith("samples") for t in texts) and any(t.startswith("config") for t in texts)
    sample_text = next(v for t, v in texts.items() if t.startswith("samples"))[0].tensor_proto.string_val[0].decode()
    assert "what is 1\\|?" in sample_text and "line 1<br>line 2" in sample_text

    # MLflow: one run, each step once (step 3 keeps the first attempt's value: no rewriting)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    run = client.get_run(first.state["mlflow_run_id"])
    assert run.info.status == "FINISHED" and client.get_experiment(run.info.experiment_id).name == "exp"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 4.0)]
    assert len(client.get_metric_history(run.info.run_id, "eval/gsm/pass_at_4")) == 4
    assert run.data.params["reward.type"] == job_json["spec"]["reward"]["type"]
    assert run.data.params["rollout.samplesPerPrompt"] == str(job_json["spec"]["rollout"]["samplesPerPrompt"])
    assert (out / "mlflow-artifacts").is_dir()  # a local store keeps artifacts with the run, not in the cwd
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert artifacts == {"samples/step-1.json", "samples/step-2.json", "samples/step-4.json"}  # the first and every 2nd
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/step-2.json", str(tmp_path))).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward", "score"] and table["data"][0][1] == "what is 2|?"

    # Weights & Biases: both attempts' offline files hold the same run; each step once
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2
    history, configs = {}, []
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == first.state["wandb_run_id"] and record.run.project == "rl"
                assert list(record.run.tags) == ["t1"]
                configs.append({u.key: json.loads(u.value_json) for u in record.run.config.update})
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                assert items["_step"] not in history  # never twice
                history[items["_step"]] = items
    assert sorted(history) == [1, 2, 3, 4]
    assert [history[s]["reward_mean"] for s in (1, 2, 3, 4)] == pytest.approx([0.1, 0.2, 0.3, 4.0])
    assert history[2]["eval/gsm/pass@4"] == 0.5 and "kl" not in history[2]
    assert history[2]["samples/_type"] == "table-file" and "samples/_type" not in history[3]
    assert configs and all(c["spec"] == job_json["spec"] for c in configs)


def test_a_tracker_that_cannot_start_is_dropped_and_the_others_log(tmp_path, caplog):
    spec = TrackingSpec.model_validate({"mlflow": {"trackingUri": "sqlite:////proc/no-such-dir/mlflow.db"}})
    trackers = _attempt(spec, tmp_path / "out", [1, 2], scale=1.0)
    assert "tracker mlflow could not start" in caplog.text
    assert [type(t).__name__ for t in trackers.trackers] == []  # closed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2]


def test_wandb_online_without_a_key_is_a_config_error_naming_the_field(tmp_path, monkeypatch):
    from rlhf_contract.trainer_config import TrainerConfig
    from rlhf_trainer.preflight import tracking_problems

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["tracking"] = {"wandb": {"project": "rl"}}
    config = TrainerConfig.from_job(RLHFJob.model_validate(doc))
    [problem] = tracking_problems(config)
    assert problem.startswith("spec.tracking.wandb.apiKeySecret:") and "mode: offline" in problem
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert tracking_problems(config) == []
    doc["spec"]["tracking"] = {"wandb": {"project": "rl", "mode": "offline"}}
    monkeypatch.delenv("WANDB_API_KEY")
    assert tracking_problems(TrainerConfig.from_job(RLHFJob.model_validate(doc))) == []


def test_tracker_links_for_the_model_card():
    """The run pages the model card links: W&B's run URL (None offline), an MLflow server's run
    page (none for a local store), only the trackers that have one."""
    from types import SimpleNamespace

    from rlhf_trainer.tracking import MlflowTracker, Trackers

    run = SimpleNamespace(run_id="r1")
    assert MlflowTracker._url(run, "https://mlflow.example/", "3", True) == "https://mlflow.example/#/experiments/3/runs/r1"
    assert MlflowTracker._url(run, "sqlite:///m.db", "3", False) is None
    trackers = Trackers.__new__(Trackers)
    trackers.trackers = [SimpleNamespace(name="tensorboard"), SimpleNamespace(name="wandb", url="https://wandb.ai/t/p/runs/x"),
                         SimpleNamespace(name="mlflow", url=None)]
    assert trackers.links() == {"wandb": "https://wandb.ai/t/p/runs/x"}
