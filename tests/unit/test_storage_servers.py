"""The download step and the outputs against real servers started here: olah (a Hub
mirror serving local git repositories offline) and versitygw (an S3-compatible gateway).
The step runs as the pods run it (`python -m rlhf_trainer.storage`, its exit code and
message); bad input ends it with exit 2 naming the field and the Secret, and leaves no copy
that could be read as complete; a server killed mid-file fails the attempt (exit 1) and
the next attempt downloads the file whole."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from rlhf_contract.outputs import MARKER
from rlhf_contract.sources import Fetch
from rlhf_trainer.storage import StorageError
from rlhf_trainer.storage.fetch import fetch_all
from rlhf_trainer.storage.publish import Publisher, restore_checkpoint
from storage_servers import STEP_SECRET, S3Server, files_of, run_step

SECRET = STEP_SECRET


@pytest.fixture(scope="module")
def hub(hub_server, tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("prompts")
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}:", "answer": str(i % 10)}) + "\n"
                                              for i in range(40)))
    commits = {"model": hub_server.add_repo("org/tiny", tiny_model_dir, tag="v1"),
               "dataset": hub_server.add_repo("org/prompts", data, kind="dataset")}
    return hub_server, commits, data


def test_hub_model_and_dataset_downloaded_once(hub, tiny_model_dir, tmp_path):
    server, commits, data = hub
    sources = tmp_path / "out" / "sources"
    fetches = [Fetch("spec.model.path", "hf://org/tiny@v1", "model", str(sources / "hf/models/org/tiny/v1")),
               Fetch("spec.data.path", "hf://org/prompts", "dataset", str(sources / "hf/datasets/org/prompts/main"))]
    env = {"HF_ENDPOINT": server.endpoint}
    first = run_step(fetches, env)
    assert first.returncode == 0, first.stderr
    model = Path(fetches[0].local)
    assert files_of(model) == {k: v for k, v in files_of(tiny_model_dir).items() if k != ".builtin"}  # not a model file
    assert files_of(Path(fetches[1].local)) == files_of(data)
    marker = json.loads(Path(fetches[0].marker()).read_text())
    assert marker["revision"] == commits["model"]  # the tag resolved to its commit
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(model).model_type == "qwen2" and AutoTokenizer.from_pretrained(model)
    (model / "sentinel").write_text("kept")  # a second run (a restart, another pod) downloads nothing
    second = run_step(fetches, env)
    assert second.returncode == 0 and second.stdout.count("already at") == 2
    assert (model / "sentinel").exists()


@pytest.mark.parametrize("uri,says", [("hf://org/missing", "no model repository 'org/missing'"),
                                      ("hf://org/tiny@no-such-tag", "revision 'no-such-tag' not found")])
def test_hub_missing_repository_or_revision_is_exit_2(hub, tmp_path, uri, says):
    fetch = Fetch("spec.model.path", uri, "model", str(tmp_path / "sources/hf/models/x"))
    proc = run_step([fetch], {"HF_ENDPOINT": hub[0].endpoint})
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "spec.model.path" in proc.stderr
    assert (f"HF_TOKEN (none set) from the Secret '{SECRET}'" in proc.stderr) == ("missing" in uri)  # maybe private
    assert not Path(fetch.local).exists() and not Path(fetch.marker()).exists()


def test_hub_copy_without_marker_is_downloaded_again(hub, tiny_model_dir, tmp_path):
    fetch = Fetch("spec.model.path", "hf://org/tiny@v1", "model", str(tmp_path / "sources/hf/models/org/tiny/v1"))
    half = Path(fetch.local)  # what a killed pod leaves: part of the files, no marker
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes()[:1000])
    os.environ["HF_ENDPOINT"] = hub[0].endpoint
    try:
        fetch_all([fetch])
    finally:
        del os.environ["HF_ENDPOINT"]
    assert files_of(half) == {k: v for k, v in files_of(tiny_model_dir).items() if k != ".builtin"}


@pytest.fixture(scope="module")
def bucket(s3_server, tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("s3data")
    (data / "train.jsonl").write_text('{"prompt": "12:", "answer": "2"}\n')
    (data / "more" / "eval.jsonl").parent.mkdir()
    (data / "more" / "eval.jsonl").write_text('{"prompt": "7:", "answer": "7"}\n')
    s3_server.put_dir("team-data", "prompts", data)
    s3_server.put_dir("team-data", "models/tiny", tiny_model_dir)
    return s3_server, data


def test_s3_prefix_and_single_object(bucket, tiny_model_dir, tmp_path):
    server, data = bucket
    sources = tmp_path / "sources"
    fetches = [Fetch("spec.model.path", "s3://team-data/models/tiny", "model", str(sources / "s3/team-data/models/tiny")),
               Fetch("spec.data.path", "s3://team-data/prompts/train.jsonl", "dataset",
                     str(sources / "s3/team-data/prompts/train.jsonl"))]
    proc = run_step(fetches, server.env())
    assert proc.returncode == 0, proc.stderr
    assert files_of(Path(fetches[0].local)) == files_of(tiny_model_dir)
    assert Path(fetches[1].local).read_bytes() == (data / "train.jsonl").read_bytes()
    assert "AWS_SECRET_ACCESS_KEY" not in proc.stdout + proc.stderr and server.env()["AWS_SECRET_ACCESS_KEY"] not in (
        proc.stdout + proc.stderr)


@pytest.mark.parametrize("uri,env,says", [
    ("s3://no-such-bucket/x", {}, "the bucket 'no-such-bucket' does not exist"),
    ("s3://team-data/nothing-here", {}, "no objects under 'nothing-here'"),
    ("s3://team-data/prompts", {"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "access denied (SignatureDoesNotMatch)"),
    ("s3://team-data/prompts", {"AWS_ACCESS_KEY_ID": "reader", "AWS_SECRET_ACCESS_KEY": "reader-secret"},
     "access denied (AccessDenied)"),
])
def test_s3_bad_input_is_exit_2(bucket, tmp_path, uri, env, says):
    server, _ = bucket
    if env.get("AWS_ACCESS_KEY_ID") == "reader":
        server.add_user("reader", "reader-secret")  # a real key, without access to team-data
    fetch = Fetch("spec.data.path", uri, "dataset", str(tmp_path / "sources/s3/x"))
    proc = run_step([fetch], server.env(**env))
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "spec.data.path" in proc.stderr
    assert (f"from the Secret '{SECRET}' (spec.storageSecret)" in proc.stderr) == says.startswith("access denied")
    assert "wrong-secret" not in proc.stderr and "reader-secret" not in proc.stderr
    assert not Path(fetch.local).exists() and not Path(fetch.marker()).exists()


def test_s3_server_killed_mid_file(tmp_path, monkeypatch):
    """A 96 MiB object; the server is SIGKILLed once part of it has arrived: the attempt fails
    (not permanent), nothing is marked complete; the next attempt gets the whole file."""
    server = S3Server(tmp_path / "server")
    try:
        big = tmp_path / "big"
        big.mkdir()
        block = os.urandom(1 << 20)
        with open(big / "weights.bin", "wb") as f:
            for i in range(96):
                f.write(block[i:] + block[:i])
        server.put_dir("killed", "model", big)
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        fetch = Fetch("spec.model.path", "s3://killed/model", "model", str(tmp_path / "out/sources/s3/killed/model"))
        partial_root = tmp_path / "out/sources/.partial"
        seen = []

        def kill_when_half_there():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                parts = [p for p in partial_root.rglob("*") if p.is_file()] if partial_root.exists() else []
                # bytes written so far (the file is made full size first, sparse, for its ranged parts)
                if parts and max(p.stat().st_blocks * 512 for p in parts) > (8 << 20):
                    seen.append(max(p.stat().st_blocks * 512 for p in parts))
                    server.kill()
                    return
                time.sleep(0.001)

        killer = threading.Thread(target=kill_when_half_there)
        killer.start()
        with pytest.raises(StorageError) as err:
            fetch_all([fetch])
        killer.join()
        assert seen and seen[0] < 96 << 20
        assert not err.value.permanent and "the next attempt downloads it again" in str(err.value)
        assert not Path(fetch.local).exists() and not Path(fetch.marker()).exists()
        server.start()
        fetch_all([fetch])
        digest = hashlib.sha256((big / "weights.bin").read_bytes()).hexdigest()
        assert hashlib.sha256((Path(fetch.local) / "weights.bin").read_bytes()).hexdigest() == digest
    finally:
        server.kill()


def test_outputs_up_and_resume_from_the_bucket(bucket, tmp_path, monkeypatch):
    """Checkpoints go up with COMPLETE last; an empty output directory gets the newest
    complete one back (a newer one without its COMPLETE is not taken)."""
    server, _ = bucket
    server.client().make_bucket("team-runs")
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    publisher = Publisher("s3://team-runs/jobs/a", None, out)
    for step in (2, 4):
        ckpt = out / "checkpoints" / f"step-{step}"
        (ckpt / "policy").mkdir(parents=True)
        (ckpt / "policy" / "shard.distcp").write_bytes(os.urandom(1000 + step))
        (ckpt / MARKER).write_text(json.dumps({"files": {}}))
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, step + 1)))
        publisher.checkpoint(ckpt)
    server.client().fput_object("team-runs", "jobs/a/checkpoints/step-6/policy/shard.distcp", str(ckpt / "policy/shard.distcp"))
    (out / "final").mkdir()
    (out / "final" / "config.json").write_text("{}")
    publisher.final(out / "final")
    names = {o.object_name for o in server.client().list_objects("team-runs", prefix="jobs/a/", recursive=True)}
    assert {"jobs/a/checkpoints/step-4/COMPLETE", "jobs/a/final/config.json", "jobs/a/metrics.jsonl"} <= names

    fresh = tmp_path / "fresh"
    said = restore_checkpoint("s3://team-runs/jobs/a", str(fresh))
    assert "restored step-4" in said
    assert files_of(fresh / "checkpoints" / "step-4") == files_of(out / "checkpoints" / "step-4")
    assert (fresh / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()
    assert "already holds" in restore_checkpoint("s3://team-runs/jobs/a", str(fresh))
    server.add_user("runs-reader", "runs-reader-secret")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "runs-reader")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "runs-reader-secret")
    with pytest.raises(StorageError) as err:  # the step proves it may write before training starts
        restore_checkpoint("s3://team-runs/jobs/a", str(tmp_path / "other"))
    assert err.value.permanent and "spec.output.uri" in str(err.value)


def test_local_mode_stops_before_anything_starts(hub, tmp_path, monkeypatch):
    """`rlhfctl run`'s first step is the pods' download step: a missing repository is a
    config error (exit 2) and no server or trainer was started."""
    from rlhf_contract.api import validate_job
    from rlhf_launcher.local import LocalConfigError, run_local

    monkeypatch.setenv("HF_ENDPOINT", hub[0].endpoint)
    job = validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "missing"},
                        "spec": {"model": {"path": "hf://org/not-there@v2"}, "data": {"path": "builtin://last-digit"}}})
    with pytest.raises(LocalConfigError) as err:
        run_local(job, output=str(tmp_path / "out"))
    assert "spec.model.path: hf://org/not-there@v2: no model repository 'org/not-there'" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "out" / "logs").iterdir()) == ["fetch.log"]
