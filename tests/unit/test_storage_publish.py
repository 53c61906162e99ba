"""Outputs going up (rlhf_trainer/storage/publish.py) against real servers: versitygw (S3),
behind a pass-through proxy that slows each checkpoint object down, and olah (the Hub's read
protocol) with the Hub's write routes in front of it (storage_servers.HubUploads).

- a checkpoint uploads on a worker while the caller trains a step; a second save waits for
  the first upload; the bucket never lists a checkpoint's COMPLETE before all its files;
- a failed upload is raised, naming the field and the checkpoint, at the next wait;
- `output.hub.every` pushes a model that transformers loads at the tag `step-N`."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf_contract.api.training import HubOutputSpec
from rlhf_contract.outputs import MARKER, manifest
from rlhf_trainer.storage import StorageError
from rlhf_trainer.storage.publish import Publisher
from storage_servers import HubUploads, Served, forward

DELAY_S = 0.4
"""Added to each PUT of a checkpoint object by the proxy."""


def make_checkpoint(out: Path, step: int, n_files: int = 4) -> Path:
    path = out / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    for i in range(n_files):
        (path / f"__{i}_0.distcp").write_bytes(os.urandom(2000 + i))
    (path / MARKER).write_text(json.dumps({"files": manifest(path)}))
    return path


@pytest.fixture
def slow_bucket(s3_server, monkeypatch):
    """The bucket `slow-runs` reached through a proxy adding DELAY_S to every checkpoint
    PUT; `puts` records (key, start, end) of each PUT as the server answered it."""
    client = s3_server.client()
    if not client.bucket_exists("slow-runs"):
        client.make_bucket("slow-runs")
    puts: list[tuple[str, float, float]] = []

    def answer(handler, body):
        start = time.monotonic()
        if handler.command == "PUT" and "/checkpoints/" in handler.path:
            time.sleep(DELAY_S)
        status, headers, data = forward(s3_server.port, handler, body)
        if handler.command == "PUT":
            puts.append((handler.path.split("?")[0].removeprefix("/slow-runs/"), start, time.monotonic()))
        return status, headers, data

    proxy = Served(answer)
    for key, value in s3_server.env(AWS_ENDPOINT_URL=proxy.url).items():
        monkeypatch.setenv(key, value)
    yield client, puts
    proxy.close()


def test_a_checkpoint_uploads_while_the_next_step_trains(slow_bucket, tmp_path):
    client, puts = slow_bucket
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    publisher = Publisher("s3://slow-runs/job", None, out)
    listings, stop = [], threading.Event()

    def watch():  # what a reader of the bucket sees, all along
        while not stop.is_set():
            listings.append({o.object_name for o in client.list_objects("slow-runs", prefix="job/", recursive=True)})
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        first = make_checkpoint(out, 1)
        began = time.monotonic()
        publisher.checkpoint(first)
        returned_s = time.monotonic() - began
        # a training step (a real forward and backward) while step-1 goes up
        model = torch.nn.Linear(64, 64)
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        stepped_while_busy = publisher.busy
        second = make_checkpoint(out, 2)
        publisher.checkpoint(second)  # waits for step-1's upload first: one in flight
        names = {o.object_name for o in client.list_objects("slow-runs", prefix="job/", recursive=True)}
        assert "job/checkpoints/step-1/COMPLETE" in names
        publisher.wait()
    finally:
        stop.set()
        watcher.join()
    assert returned_s < DELAY_S, f"checkpoint() blocked {returned_s:.2f} s: the upload is on the critical path"
    assert stepped_while_busy, "the upload was over before the step finished"
    assert model.weight.grad is not None
    # COMPLETE went up only after every other file of its checkpoint was answered
    for step in (1, 2):
        prefix = f"job/checkpoints/step-{step}/"
        files = [(k, s, e) for k, s, e in puts if k.startswith(prefix)]
        marker = next(s for k, s, e in files if k == prefix + MARKER)
        assert len(files) == 5 and all(e <= marker for k, s, e in files if k != prefix + MARKER)
    # and no listing ever showed a COMPLETE without all its files; some showed a partial upload
    for step, path in ((1, first), (2, second)):
        prefix = f"job/checkpoints/step-{step}/"
        whole = {prefix + name for name in manifest(path)}
        assert all(whole <= seen for seen in listings if prefix + MARKER in seen)
    assert any(("job/checkpoints/step-1/__0_0.distcp" in seen and "job/checkpoints/step-1/" + MARKER not in seen)
               for seen in listings), "the watcher never saw an upload in progress"
    assert client.get_object("slow-runs", "job/metrics.jsonl").read() == (out / "metrics.jsonl").read_bytes()
    publisher.close()


def test_a_failed_upload_fails_at_the_next_save_naming_it(s3_server, tmp_path, monkeypatch, caplog):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    publisher = Publisher("s3://no-such-bucket/job", None, out)
    publisher.checkpoint(make_checkpoint(out, 1))  # returns; the failure is the worker's
    with pytest.raises(StorageError) as err:
        publisher.checkpoint(make_checkpoint(out, 2))
    said = str(err.value)
    assert said.startswith("spec.output.uri: uploading checkpoint step-1 to s3://no-such-bucket/job")
    assert "the bucket 'no-such-bucket' does not exist" in said and err.value.permanent
    publisher.checkpoint(make_checkpoint(out, 3))
    publisher.close()  # a run already failing: logged, not raised over its own error
    assert "uploading checkpoint step-3" in caplog.text


@pytest.fixture(scope="module")
def hub_uploads(hub_server):
    shim = HubUploads(hub_server)
    yield shim
    shim.close()


def test_hub_every_pushes_a_model_transformers_loads(hub_uploads, tiny_model_dir, tmp_path, monkeypatch):
    from huggingface_hub import ModelCard, snapshot_download
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainer.checkpoint import save_final

    monkeypatch.setenv("HF_ENDPOINT", hub_uploads.endpoint)
    out = tmp_path / "run"
    publisher = Publisher(None, HubOutputSpec(repo="team/tuned", every=1), out)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    pushed = {}
    for step in (1, 2):
        with torch.no_grad():  # "trained": each step's weights differ
            model.model.embed_tokens.weight.add_(0.25 * step)
        saved = save_final(out, model, tokenizer, name=f"hub/step-{step}")
        (saved / "README.md").write_text(f"---\nlicense: apache-2.0\n---\n# step {step}\n")
        pushed[step] = {k: v.clone() for k, v in model.state_dict().items()}
        publisher.checkpoint(make_checkpoint(out, step), saved)
        publisher.wait()
        assert not saved.exists()  # deleted once pushed
    assert [m for _, m, _ in hub_uploads.commits] == ["rlhf-operator: step 1", "rlhf-operator: step 2"]

    for revision, step in (("step-1", 1), ("step-2", 2), ("main", 2)):
        local = snapshot_download("team/tuned", revision=revision, endpoint=hub_uploads.endpoint,
                                  cache_dir=tmp_path / "cache")
        assert not list(Path(local).glob("*.distcp")) and (Path(local) / "model.safetensors").exists()
        loaded = AutoModelForCausalLM.from_pretrained(local)
        state = loaded.state_dict()
        assert all(state[k].equal(v) for k, v in pushed[step].items() if k in state), revision
        assert AutoTokenizer.from_pretrained(local)("7 8 9")["input_ids"] == tokenizer("7 8 9")["input_ids"]
        assert ModelCard.load(Path(local) / "README.md").data.license == "apache-2.0"
    publisher.close()
