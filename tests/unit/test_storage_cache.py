"""The download cache shared by jobs (`spec.sourceCache`, rlhf_trainer/storage/cache.py)
against the real servers: olah (Hub) and versitygw (S3), each behind a pass-through proxy
that counts the requests. Two jobs (two output directories) with one cache download each
object once; a changed object (a new ETag, a new commit) is downloaded again under a new
name; the job's sources path is a link to the cache entry, whose files are read-only."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

from rlhf_contract.sources import Fetch
from storage_servers import Served, forward
from test_storage_servers import files_of, run_step


def _counting(port: int) -> Served:
    return Served(lambda handler, body: forward(port, handler, body))


def _gets(proxy: Served, marker: str) -> list[str]:
    """The object GETs (not listings, not API calls) whose path contains `marker`."""
    return [path for method, path, _, _ in proxy.requests
            if method == "GET" and marker in path and "list-type" not in path and "/api/" not in path]


def _job(tmp: Path, name: str, uri: str, kind: str, local: str) -> Fetch:
    return Fetch("spec.model.path", uri, kind, str(tmp / name / "sources" / local))


def test_s3_two_jobs_share_one_download_and_a_changed_object_is_fetched_again(s3_server, tiny_model_dir,
                                                                              tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    s3_server.put_dir("team-cache", "models/tiny", model)
    proxy, cache = _counting(s3_server.port), tmp_path / "cache"
    env = s3_server.env(AWS_ENDPOINT_URL=proxy.url)
    try:
        uri = "s3://team-cache/models/tiny"
        jobs = [_job(tmp_path, f"job-{i}", uri, "model", "s3/team-cache/models/tiny") for i in (1, 2)]
        for job in jobs:
            proc = run_step([job], env, "--cache", str(cache))
            assert proc.returncode == 0, proc.stderr
        names = sorted(f.name for f in model.iterdir())
        got = _gets(proxy, "/team-cache/models/tiny/")
        assert sorted(p.rsplit("/", 1)[1] for p in got) == names  # each object once, for both jobs
        assert "found in the cache" in proc.stdout
        for job in jobs:
            local = Path(job.local)
            assert local.is_symlink() and local.resolve().is_relative_to(cache.resolve())
            assert files_of(local) == files_of(model)
        entry = Path(jobs[0].local).resolve()
        assert all(not (f.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) for f in entry.rglob("*"))
        assert json.loads(Path(jobs[1].marker()).read_text())["cache"] == str(Path(jobs[0].local).readlink())

        # a changed object: a third job pins the new ETag and downloads the prefix anew, elsewhere
        (model / "config.json").write_text((model / "config.json").read_text() + "\n")
        s3_server.put_dir("team-cache", "models/tiny", model)
        before = len(_gets(proxy, "/team-cache/models/tiny/"))
        third = _job(tmp_path, "job-3", uri, "model", "s3/team-cache/models/tiny")
        proc = run_step([third], env, "--cache", str(cache))
        assert proc.returncode == 0, proc.stderr
        assert len(_gets(proxy, "/team-cache/models/tiny/")) - before == len(names)
        assert Path(third.local).resolve() != entry and files_of(Path(third.local)) == files_of(model)
        assert files_of(entry)["config.json"] != (model / "config.json").read_bytes()  # the first entry kept
        # the first job still reads its pinned ETags: its own copy, untouched by the third
        again = run_step([jobs[0]], env, "--cache", str(cache))
        assert again.returncode == 0 and "already at" in again.stdout
    finally:
        proxy.close()


def test_hub_two_jobs_share_one_download_and_a_new_commit_is_fetched_again(hub_server, tiny_model_dir, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo)
    first_commit = hub_server.add_repo("org/cached", repo)
    proxy, cache = _counting(int(hub_server.endpoint.rsplit(":", 1)[1])), tmp_path / "cache"
    env = {"HF_ENDPOINT": proxy.url}
    try:
        jobs = [_job(tmp_path, f"job-{i}", "hf://org/cached", "model", "hf/models/org/cached/main") for i in (1, 2)]
        for job in jobs:
            proc = run_step([job], env, "--cache", str(cache))
            assert proc.returncode == 0, proc.stderr
        got = _gets(proxy, "/resolve/")
        landed = sorted(f.name for f in Path(jobs[0].local).iterdir())
        assert {"config.json", "model.safetensors"} <= set(landed)  # what from_pretrained reads (hub_files.py)
        assert sorted(p.rsplit("/", 1)[1] for p in got) == landed  # each file once, for both jobs
        entry = Path(jobs[0].local).resolve()
        assert entry == (cache / "hf/models/org/cached" / first_commit).resolve()
        assert Path(jobs[1].local).resolve() == entry
        assert all((entry / name).read_bytes() == (repo / name).read_bytes() for name in landed)

        # a new commit on main: the next job pins it and downloads it once more, beside the first
        mirror = hub_server.mirrors / "models/org/cached"
        (mirror / "config.json").write_text((mirror / "config.json").read_text() + "\n")
        git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
        subprocess.run([*git, "commit", "-qam", "change"], cwd=mirror, check=True)
        second_commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=mirror, check=True, capture_output=True,
                                       text=True).stdout.strip()
        before = len(_gets(proxy, "/resolve/"))
        third = _job(tmp_path, "job-3", "hf://org/cached", "model", "hf/models/org/cached/main")
        proc = run_step([third], env, "--cache", str(cache))
        assert proc.returncode == 0, proc.stderr
        assert len(_gets(proxy, "/resolve/")) > before
        assert Path(third.local).resolve() == (cache / "hf/models/org/cached" / second_commit).resolve()
        assert (Path(third.local) / "config.json").read_bytes() == (mirror / "config.json").read_bytes()
        assert (entry / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    finally:
        proxy.close()


def test_a_damaged_cache_entry_is_downloaded_again(s3_server, tiny_model_dir, tmp_path):
    """An entry whose file lost bytes (its size differs from its marker) is not linked: the
    next job downloads the entry again, whole."""
    s3_server.put_dir("team-cache", "models/damaged", tiny_model_dir)
    cache, env = tmp_path / "cache", s3_server.env()
    first = _job(tmp_path, "job-1", "s3://team-cache/models/damaged", "model", "s3/team-cache/models/damaged")
    assert run_step([first], env, "--cache", str(cache)).returncode == 0
    weights = Path(first.local).resolve() / "model.safetensors"
    os.chmod(weights, 0o644)
    weights.write_bytes(weights.read_bytes()[:100])
    second = _job(tmp_path, "job-2", "s3://team-cache/models/damaged", "model", "s3/team-cache/models/damaged")
    proc = run_step([second], env, "--cache", str(cache))
    assert proc.returncode == 0 and "downloaded into the cache" in proc.stdout, proc.stderr
    assert files_of(Path(second.local)) == files_of(tiny_model_dir) == files_of(Path(first.local))
