"""The download step against a bucket writer and a moving source (issue 49), with the real
servers: versitygw (behind `HostileS3`, which lists the object names a server that allows
any key would list: versitygw's posix backend cannot store a `..` segment) and olah.

A key with `..` fails the step naming it (exit 2) and nothing lands outside the cache, on
download and on restore; two downloads into one cache whose lock does not hold end with a
whole copy; a copy whose files differ from its marker is downloaded again; a job's sources
are pinned by its first download (a changed S3 object fails the step, a moved Hub branch is
not followed) and the trainer reports the pins."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

import pytest

from rlhf_contract.sources import Fetch
from rlhf_trainer.storage import StorageError, fetch as fetch_module, s3
from rlhf_trainer.storage.fetch import fetch_all
from rlhf_trainer.storage.publish import restore_checkpoint
from storage_servers import Served, forward
from test_storage_servers import files_of, run_step


class HostileS3(Served):
    """A pass-through proxy to `server` whose ListObjectsV2 answers also list `planted`
    keys (bucket -> names), as AWS S3 would for a bucket writer who put them there."""

    def __init__(self, server, planted: dict[str, list[str]]):
        def answer(handler, body):
            status, headers, data = forward(server.port, handler, body)
            url = urlsplit(handler.path)
            query = parse_qs(url.query)
            bucket = url.path.strip("/").split("/")[0]
            if handler.command == "GET" and "list-type" in query and "/" not in url.path.strip("/"):
                prefix = query.get("prefix", [""])[0]
                extra = "".join(f"<Contents><Key>{escape(k)}</Key><LastModified>2026-11-28T00:00:00.000Z"
                                f"</LastModified><ETag>&quot;0f0f&quot;</ETag><Size>6</Size><StorageClass>"
                                f"STANDARD</StorageClass></Contents>"
                                for k in planted.get(bucket, []) if k.startswith(prefix))
                data = data.replace(b"</ListBucketResult>", extra.encode() + b"</ListBucketResult>")
            return status, headers, data

        super().__init__(answer)
        self.endpoint = self.url


@pytest.fixture(scope="module")
def hostile(s3_server, tiny_model_dir):
    s3_server.put_dir("hostile", "models/tiny", tiny_model_dir)
    proxy = HostileS3(s3_server, {"hostile": ["models/tiny/../escape", "models/tiny/a/../../../x",
                                              "models/tiny/../../.complete/0123456789abcdef.json",
                                              "runs/checkpoints/step-3/COMPLETE",
                                              "runs/checkpoints/step-3/../../../../planted.pt"]})
    yield s3_server, proxy
    proxy.close()


def outside(root: Path, inside: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_relative_to(inside)}


def test_hostile_keys_fail_the_step_naming_the_key_and_write_nothing_outside(hostile, tmp_path):
    server, proxy = hostile
    out = tmp_path / "job" / "out"
    fetch = Fetch("spec.model.path", "s3://hostile/models/tiny", "model", str(out / "sources/s3/hostile/models/tiny"))
    (out / "sources").mkdir(parents=True)
    before = outside(tmp_path, out / "sources")
    proc = run_step([fetch], server.env(AWS_ENDPOINT_URL=proxy.endpoint))
    assert proc.returncode == 2, proc.stderr  # permanent: no restart can fix the bucket
    assert "spec.model.path" in proc.stderr and "refusing the object name '../escape'" in proc.stderr
    assert outside(tmp_path, out / "sources") == before
    assert not (out / "sources/.complete").exists() or not list((out / "sources/.complete").glob("*.json"))
    assert not Path(fetch.local).exists()


def test_hostile_checkpoint_keys_are_refused_on_restore(hostile, tmp_path, monkeypatch):
    server, proxy = hostile
    for key, value in server.env(AWS_ENDPOINT_URL=proxy.endpoint).items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "job" / "out"
    with pytest.raises(StorageError) as err:
        restore_checkpoint("s3://hostile/runs", str(out))
    assert err.value.permanent and "'../../../../planted.pt'" in str(err.value)
    assert not (tmp_path / "job" / "planted.pt").exists() and not (tmp_path / "planted.pt").exists()
    assert not (out / "checkpoints" / "step-3").exists()


def test_confined_refuses_each_escape(tmp_path):
    from rlhf_trainer.storage.files import confined

    for name in ("../escape", "a/../../x", "/etc/passwd", "a//b", "./a", "a/.."):
        with pytest.raises(StorageError) as err:
            confined(tmp_path, name, "spec.data.path: s3://b/p")
        assert err.value.permanent and repr(name) in str(err.value)
    (tmp_path / "link").symlink_to("/")
    with pytest.raises(StorageError):
        confined(tmp_path, "link/etc/passwd", "x")
    assert confined(tmp_path, "a/b.json", "x") == tmp_path / "a" / "b.json"


@pytest.fixture(scope="module")
def shards(s3_server, tmp_path_factory):
    model = tmp_path_factory.mktemp("sharded")
    for i in range(6):
        (model / f"model-{i:05d}-of-00006.safetensors").write_bytes(bytes([i]) * (200_000 + i))
    (model / "config.json").write_text("{}")
    s3_server.put_dir("shards", "m", model)
    return s3_server, model


def test_two_downloads_whose_lock_does_not_hold_end_with_a_whole_copy(shards, tmp_path, monkeypatch):
    """Two pods on different nodes (the lock is a no-op) download the same copy at once,
    each into its own staging directory: the copy left is whole and marked as such."""
    server, model = shards
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(fetch_module.fcntl, "flock", lambda *a: None)
    both_listed = threading.Barrier(2, timeout=30)
    listed = s3.list_objects

    def list_together(*args):
        found = listed(*args)
        both_listed.wait()
        return found

    get = s3.client().__class__.fget_object

    def slow_get(self, *args, **kwargs):
        time.sleep(0.05)
        return get(self, *args, **kwargs)

    monkeypatch.setattr(s3, "list_objects", list_together)
    monkeypatch.setattr(s3.client().__class__, "fget_object", slow_get)
    fetch = Fetch("spec.model.path", "s3://shards/m", "model", str(tmp_path / "out/sources/s3/shards/m"))
    errors = []

    def pod():
        try:
            fetch_all([fetch])
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    pods = [threading.Thread(target=pod) for _ in range(2)]
    for p in pods:
        p.start()
    for p in pods:
        p.join(120)
    assert errors == []
    assert files_of(Path(fetch.local)) == files_of(model)
    marker = json.loads(Path(fetch.marker()).read_text())
    assert {name: entry["size"] for name, entry in marker["files"].items()} == {
        p.name: p.stat().st_size for p in model.iterdir()}
    assert not list((tmp_path / "out/sources/.partial").iterdir())


def test_a_copy_that_differs_from_its_marker_is_downloaded_again(shards, tmp_path, monkeypatch):
    server, model = shards
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    fetch = Fetch("spec.model.path", "s3://shards/m", "model", str(tmp_path / "sources/s3/shards/m"))
    stem = Path(fetch.marker()).stem
    abandoned = tmp_path / f"sources/.partial/{stem}.{socket.gethostname()}.999999999.0a0b"  # a killed pod's
    (abandoned / "content").mkdir(parents=True)
    fetch_all([fetch])
    assert not abandoned.exists()
    (Path(fetch.local) / "model-00003-of-00006.safetensors").unlink()  # 5 of 6 shards, marker still there
    line, = fetch_all([fetch])
    assert "downloaded to" in line and files_of(Path(fetch.local)) == files_of(model)
    Path(fetch.marker()).write_text('{"uri": "s3://shards/m", "files": {"con')  # a marker cut short
    assert "downloaded to" in fetch_all([fetch])[0]
    assert "already at" in fetch_all([fetch])[0]


def test_a_pinned_s3_object_that_changed_fails_the_step(s3_server, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1:", "answer": "1"}\n')
    s3_server.put_dir("pinned", "d", data)
    out = tmp_path / "out"
    fetch = Fetch("spec.data.path", "s3://pinned/d/train.jsonl", "dataset", str(out / "sources/s3/pinned/d/train.jsonl"))
    assert run_step([fetch], s3_server.env()).returncode == 0
    (data / "train.jsonl").write_text('{"prompt": "2:", "answer": "2"}\n')  # replaced in the bucket
    s3_server.put_dir("pinned", "d", data)
    Path(fetch.local).unlink()  # another pod of the job (or a restart) without the copy
    proc = run_step([fetch], s3_server.env())
    assert proc.returncode == 2, proc.stderr
    assert "the object 'd/train.jsonl' changed after this job pinned it" in proc.stderr
    assert not Path(fetch.local).exists()
    assert list(json.loads(Path(fetch.pin_file()).read_text())["objects"]) == ["d/train.jsonl"]


def test_a_moved_hub_branch_is_not_followed_within_a_job(hub_server, tiny_model_dir, tmp_path, monkeypatch):
    """The trainer's download pins `main` to its commit; the branch moves; the rollout
    pod's download (and a restart's) on the job's volume reads the pinned commit, a new
    job reads the new one; the trainer reports the pin."""
    first = hub_server.add_repo("org/moving", tiny_model_dir)
    env = {"HF_ENDPOINT": hub_server.endpoint}
    out = tmp_path / "out"
    local = str(out / "sources/hf/models/org/moving/main")
    trainer = [Fetch("spec.model.path", "hf://org/moving", "model", local)]
    proc = run_step(trainer, env)
    assert proc.returncode == 0, proc.stderr
    repo = hub_server.mirrors / "models" / "org" / "moving"
    (repo / "config.json").write_text('{"moved": true}')
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "commit", "-qam", "move main"], cwd=repo, check=True)
    moved = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert moved != first
    Path(trainer[0].marker()).unlink()  # the rollout pod / a restart downloads again
    proc = run_step(trainer, env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(Path(trainer[0].marker()).read_text())["revision"] == first
    assert (Path(local) / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    other_job = Fetch("spec.model.path", "hf://org/moving", "model", str(tmp_path / "new/sources/hf/models/org/moving/main"))
    assert run_step([other_job], env).returncode == 0
    assert json.loads(Path(other_job.marker()).read_text())["revision"] == moved

    from rlhf_trainer.progress import ApiServer, ProgressReporter

    monkeypatch.setenv("RLHF_OUTPUT_DIR", str(out))
    config = type("Config", (), {"job_name": "j", "namespace": "ns", "schedule": type("S", (), {"total_steps": 3})})
    reporter = ProgressReporter.from_config(config)
    reporter.api = ApiServer(url="http://127.0.0.1:9", token_file=tmp_path / "t", ca_file=None)
    sent = []
    monkeypatch.setattr(ProgressReporter, "_send", lambda self, progress: sent.append(progress) or True)
    reporter.report(1, reward_mean=0.5)
    reporter.close()
    assert sent[-1]["sources"] == {"hf://org/moving": first}


def test_a_copy_installed_between_the_check_and_the_rename_is_moved_aside_not_an_error(tmp_path, monkeypatch):
    """The race of the test above, made certain: another process renames its whole copy into
    place after this one looked (nothing there) and before its own rename, which the kernel
    refuses (ENOTEMPTY). This copy still ends in place and the other's is moved aside."""
    import os

    target, mine, other = tmp_path / "copy", tmp_path / "mine", tmp_path / "other"
    for staging, text in ((mine, "mine"), (other, "other")):
        (staging / "content").mkdir(parents=True)
        (staging / "content" / "f").write_text(text)
    rename = os.replace

    def racing(src, dst):
        if Path(src) == mine / "content" and (other / "content").exists():
            rename(other / "content", target)  # the other process wins the first race
        return rename(src, dst)

    monkeypatch.setattr(os, "replace", racing)
    fetch_module._install(target, mine)
    assert (target / "f").read_text() == "mine" and (mine / "replaced-1" / "f").read_text() == "other"
