"""`rlhfctl submit --working-dir`: a directory into ConfigMaps and the job rewritten to mount
them (rlhf_launcher/workdir.py), and which files go (workdir_files.py). The files a pod would
see are rebuilt from the manifests as the kubelet projects them (each source's items, `data`
as text, `binaryData` base64), and the job must pass the operator's own pod-settings check.
A hostile directory (credentials, keys, links out of it, a fifo, a 1.5 GiB sparse file) is
refused before a byte of it is read."""

from __future__ import annotations

import base64
import copy
import os
import re
import tracemalloc
from pathlib import Path

import pytest
import yaml

from rlhf_contract.api import validate_job
from rlhf_launcher.cli import main
from rlhf_launcher.workdir import (
    CONFIGMAP_BYTES, MAX_CONFIGMAPS, MIB, WORKDIR_MOUNT, WORKDIR_VOLUME, WorkdirError, left_behind, pack,
)
from rlhf_launcher.workdir_files import Entry, Selection, credential_problems, human, select
from rlhf_operator.builders.pods import PodSettings, PodSettingsError

KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # the API server's ConfigMap key rule


def job_doc(**spec) -> dict:
    base = {"model": {"path": "/models/tiny"}, "data": {"path": "wd/data/train.jsonl"},
            "reward": {"type": "python", "file": "wd/reward.py"},
            "pod": {"volumes": [{"name": "work", "emptyDir": {}}],
                    "volumeMounts": [{"name": "work", "mountPath": "/models"}, {"name": "work", "mountPath": "/output"}]}}
    base.update(spec)
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "wd-job"}, "spec": base}


def projected(config_maps: list[dict], volume: dict) -> dict[str, bytes]:
    """What a pod sees under the mount: each item's key written at its path."""
    by_name = {cm["metadata"]["name"]: cm for cm in config_maps}
    out = {}
    for source in volume["projected"]["sources"]:
        cm = by_name[source["configMap"]["name"]]
        for item in source["configMap"]["items"]:
            key = item["key"]
            assert KEY.match(key), key
            assert item["path"] not in out
            out[item["path"]] = (cm["data"][key].encode() if key in cm.get("data", {})
                                 else base64.b64decode(cm["binaryData"][key]))
    return out


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    wd = tmp_path / "wd"
    (wd / "data").mkdir(parents=True)
    (wd / "reward.py").write_text("def reward_fn(response, answer, extra_info):\n    return 1.0\n")
    (wd / "data" / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (wd / "data" / "my file (1).bin").write_bytes(bytes(range(256)))  # not UTF-8; a key needs its name changed
    (wd / ".git").mkdir()
    (wd / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (wd / "__pycache__").mkdir()
    (wd / "__pycache__" / "reward.cpython-311.pyc").write_bytes(b"\0" * 10)
    return wd


def test_the_pods_see_the_directory_at_the_rewritten_paths(workdir: Path):
    doc = job_doc()
    packed = pack(copy.deepcopy(doc), validate_job(copy.deepcopy(doc)), Path("wd"), workdir.parent, "ns1")
    volume = next(v for v in packed.doc["spec"]["pod"]["volumes"] if v["name"] == WORKDIR_VOLUME)
    seen = projected(packed.config_maps, volume)
    assert seen == {"reward.py": (workdir / "reward.py").read_bytes(),
                    "data/train.jsonl": (workdir / "data" / "train.jsonl").read_bytes(),
                    "data/my file (1).bin": bytes(range(256))}  # hidden entries and __pycache__ stay here
    assert packed.moved == {"spec.data.path": f"{WORKDIR_MOUNT}/data/train.jsonl",
                            "spec.reward.file": f"{WORKDIR_MOUNT}/reward.py"}
    job = validate_job(copy.deepcopy(packed.doc))
    assert (job.spec.reward.file, job.spec.data.path) == (f"{WORKDIR_MOUNT}/reward.py", f"{WORKDIR_MOUNT}/data/train.jsonl")
    assert {"name": WORKDIR_VOLUME, "mountPath": WORKDIR_MOUNT, "readOnly": True} in packed.doc["spec"]["pod"]["volumeMounts"]
    PodSettings.from_job(job)  # the operator accepts it: the data is on a mounted volume now
    with pytest.raises(PodSettingsError, match="spec.data.path"):
        PodSettings.from_job(validate_job(doc))  # and refused it before
    assert [cm["metadata"] for cm in packed.config_maps] == [
        {"name": "wd-job-workdir", "namespace": "ns1", "labels": {"rlhf.dev/workdir-of": "wd-job"}}]
    assert doc == job_doc()  # the caller's document is left alone


def test_a_larger_directory_is_split_over_config_maps(tmp_path: Path):
    wd = tmp_path / "big"
    wd.mkdir()
    (wd / "reward.py").write_text("def reward_fn(r, a, e):\n    return 0.0\n")
    for i in range(MAX_CONFIGMAPS):  # 0.6 MiB each: one ConfigMap holds one of them
        (wd / f"part{i}.txt").write_text(str(i) * int(0.6 * MIB))
    doc = job_doc(data={"path": "/models/data.jsonl"}, reward={"type": "python", "file": "big/reward.py"})
    packed = pack(doc, validate_job(copy.deepcopy(doc)), Path("big"), tmp_path, "ns")
    assert [cm["metadata"]["name"] for cm in packed.config_maps] == [
        f"wd-job-workdir-{i + 1}" for i in range(MAX_CONFIGMAPS)]
    for cm in packed.config_maps:
        assert sum(len(k) + len(v) for k, v in cm["data"].items()) <= CONFIGMAP_BYTES
    volume = packed.doc["spec"]["pod"]["volumes"][-1]
    files = projected(packed.config_maps, volume)
    assert files == {p.name: p.read_bytes() for p in wd.iterdir()}


@pytest.mark.parametrize("sizes, why", [([0.6] * (MAX_CONFIGMAPS + 1), f"needs {MAX_CONFIGMAPS + 1} ConfigMaps"),
                                        ([1.2], "alone does not fit")])
def test_too_large_is_refused_with_its_size_and_what_to_do(tmp_path: Path, sizes, why, capsys, monkeypatch):
    wd = tmp_path / "wd"
    (wd / "data").mkdir(parents=True)
    (wd / "reward.py").write_text("def reward_fn(r, a, e):\n    return 0.0\n")
    for i, size in enumerate(sizes):
        (wd / "data" / f"part{i}.jsonl").write_text("x" * int(size * MIB))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_doc(data={"path": "wd/data/part0.jsonl"})))
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(job), "--working-dir", "wd", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    total = sum(sizes) * MIB + (wd / "reward.py").stat().st_size
    assert out == "" and why in err
    assert f"{len(sizes) + 1} files, {total / MIB:.1f} MiB in all (largest: data/part" in err
    assert "PersistentVolumeClaim" in err and "only code and small files" in err


def test_a_path_in_the_directory_that_is_not_sent_is_named(workdir: Path):
    doc = job_doc(environment={"file": "wd/.git/HEAD"})
    with pytest.raises(WorkdirError, match=r"spec.environment.file: 'wd/.git/HEAD' is inside --working-dir wd"):
        pack(doc, validate_job(copy.deepcopy(doc)), Path("wd"), workdir.parent, "ns")


def test_local_files_left_behind_are_warned_about(workdir: Path):
    job = validate_job(job_doc(reward={"type": "python", "file": "wd/reward.py"}))
    assert [w.split(":")[0] for w in left_behind(job, workdir.parent, None)] == ["spec.data.path", "spec.reward.file"]
    assert left_behind(job, workdir.parent, workdir) == []


def test_submit_dry_run_prints_the_config_map_and_the_job(workdir: Path, capsys, monkeypatch):
    monkeypatch.chdir(workdir.parent)
    job = workdir.parent / "job.yaml"
    job.write_text(yaml.safe_dump(job_doc()))
    assert main(["submit", str(job), "--working-dir", "wd", "--dry-run", "-n", "team-a"]) == 0
    cm, rlhfjob = yaml.safe_load_all(capsys.readouterr().out)
    assert cm["kind"] == "ConfigMap" and cm["data"]["reward.py"] == (workdir / "reward.py").read_text()
    assert rlhfjob["metadata"] == {"name": "wd-job", "namespace": "team-a"}
    assert rlhfjob["spec"]["reward"]["file"] == f"{WORKDIR_MOUNT}/reward.py"
    job.write_text(yaml.safe_dump({**job_doc(), "metadata": {"name": "wd-job", "namespace": "team-b"}}))
    assert main(["submit", str(job), "--working-dir", "wd", "--dry-run", "-n", "team-a"]) == 2
    assert "metadata.namespace: 'team-b' differs from --namespace team-a" in capsys.readouterr().err


def test_the_examples_reward_file_is_what_the_trainer_loads():
    """examples/boxed_reward.py (sent by `--working-dir examples`) through the trainer's own loader."""
    from rlhf_trainer.rewards.forms import python_reward
    from rlhf_trainer.rewards.sample import Sample

    root = Path(__file__).resolve().parents[2]
    job = validate_job(yaml.safe_load((root / "examples" / "cluster-custom-reward.yaml").read_text()))
    reward = python_reward(str(root / job.spec.reward.file), job.spec.reward.function)
    assert reward([Sample(r"so \boxed{4}", "4", {}), Sample(r"\boxed{3} or \boxed{ 5 }", "5", {}),
                   Sample("4", "4", {})]) == [(1.1, 1.0), (1.1, 1.0), (0.0, 0.0)]


# ---- which files go

SENT_LINE = re.compile(r"^  +(\d+(?:\.\d)? (?:B|KiB|MiB|GiB))  (\S.*?)(?: \(-> .*\))?$")


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch) -> Path:
    """A working directory with what must not leave this machine, beside what should."""
    wd = tmp_path / "wd"
    (wd / "data").mkdir(parents=True)
    (wd / "reward.py").write_text("def reward_fn(response, answer, extra_info):\n    return 1.0\n")
    (wd / "data" / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (wd / "credentials").write_text("[default]\naws_secret_access_key = abc\n")
    (wd / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn\n-----END OPENSSH PRIVATE KEY-----\n")
    (wd / ".env").write_text("HF_TOKEN=hf_abc\n")
    (tmp_path / "outside.txt").write_text("not yours\n")
    (wd / "environ").symlink_to("/proc/self/environ")
    (wd / "up").symlink_to("../outside.txt")
    (wd / "same-reward.py").symlink_to("reward.py")  # inside: sent as a copy
    os.mkfifo(wd / "pipe")  # opened, it would hang
    (wd / ".gitignore").write_text("build/\n*.log\n")
    (wd / "build").mkdir()
    (wd / "build" / "out.bin").write_bytes(b"\0" * 100)
    (wd / "debug.log").write_text("log\n")
    (wd / "sub").mkdir()
    (wd / "sub" / ".gitignore").write_text("local.txt\n")
    (wd / "sub" / "local.txt").write_text("nested-ignored\n")
    (wd / "sub" / "kept.txt").write_text("kept\n")
    (wd / ".rlhfignore").write_text("notes-ignored.txt\n!.env\n")  # and re-includes a hidden file
    (wd / "notes-ignored.txt").write_text("x\n")
    (wd / "scratch").mkdir()
    (wd / "scratch" / "notes.txt").write_text("excluded\n")
    with open(wd / "huge.bin", "wb"):
        pass
    os.truncate(wd / "huge.bin", 1536 * MIB)  # sparse: 1.5 GiB on paper, no disk
    (wd / ".git").mkdir()
    (wd / ".git" / "config").write_text("[core]\n")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job_doc()))
    monkeypatch.chdir(tmp_path)
    return wd


def test_a_hostile_directory_is_refused_naming_each_file_before_any_is_read(hostile: Path, capsys):
    tracemalloc.start()
    try:
        code = main(["submit", "job.yaml", "--working-dir", "wd", "--dry-run", "--exclude", "scratch/"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: --working-dir wd: nothing sent:\n  - ")
    problems = err.split("\n  - ")[1:]
    assert [p.split(" ")[0] for p in problems] == ["environ", "up", ".env", "credentials", "id_rsa", "8"]
    assert problems[0].startswith("environ -> /proc/self/environ leaves the directory (/proc/")
    assert problems[1].startswith(f"up -> ../outside.txt leaves the directory ({hostile.parent / 'outside.txt'})")
    for name in (".env", "credentials", "id_rsa"):
        assert f"{name} looks like a credential (its name): leave it out" in err
        assert f"send it on purpose: --include-secret {name}\n" in err
    assert problems[5].startswith("8 files, 1.5 GiB in all (largest: huge.bin, 1.5 GiB); huge.bin alone does not "
                                  "fit in one ConfigMap")  # by stat: it was not read
    assert "pipe" not in err  # skipped, never opened: not a reason to refuse
    assert peak < 100 * MIB, f"{peak / MIB:.0f} MiB traced: a file was read before its size was checked"


def test_what_is_sent_is_what_was_listed(hostile: Path, capsys):
    (hostile / "id_rsa").unlink()
    argv = ["submit", "job.yaml", "--working-dir", "wd", "--dry-run", "-o", "yaml",
            "--exclude", "scratch/", "--exclude", "huge.bin", "--exclude", "/environ", "--exclude", "up",
            "--exclude", ".env", "--include-secret", "credentials"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    *config_maps, job = yaml.safe_load_all(out)
    volume = next(v for v in job["spec"]["pod"]["volumes"] if v["name"] == WORKDIR_VOLUME)
    sent = projected(config_maps, volume)
    assert sent == {"credentials": (hostile / "credentials").read_bytes(),  # named: it goes
                    "data/train.jsonl": (hostile / "data" / "train.jsonl").read_bytes(),
                    "reward.py": (hostile / "reward.py").read_bytes(),
                    "same-reward.py": (hostile / "reward.py").read_bytes(),
                    "sub/kept.txt": b"kept\n"}
    listed = {m.group(2): m.group(1) for m in map(SENT_LINE.match, err.splitlines()) if m}
    assert listed == {path: human(len(data)) for path, data in sent.items()}
    assert f"--working-dir wd: sending 5 files, {human(sum(map(len, sent.values())))} in all, in " \
           "configmap/wd-job-workdir:" in err
    assert "  skipped     pipe (a fifo: not read)" in err
    assert "same-reward.py (-> reward.py)" in err
    assert ("  left out    .env, .git, .gitignore, .rlhfignore, build, debug.log, environ, huge.bin and 5 more "
            "(.git, hidden, __pycache__, .gitignore, .rlhfignore, --exclude)") in err


def test_a_path_field_left_out_by_a_rule_names_the_rule(workdir: Path):
    (workdir / ".gitignore").write_text("# generated\ndata/\n")
    doc = job_doc()
    with pytest.raises(WorkdirError, match=r"spec.data.path: 'wd/data/train.jsonl' is inside --working-dir wd but no "
                                           r"file of it is sent \(data is left out: .gitignore:2 'data/'\)"):
        pack(doc, validate_job(copy.deepcopy(doc)), Path("wd"), workdir.parent, "ns")
    with pytest.raises(WorkdirError, match=r"--exclude 'train\.jsonl'"):
        (workdir / ".gitignore").unlink()
        pack(doc, validate_job(copy.deepcopy(doc)), Path("wd"), workdir.parent, "ns", Selection(("train.jsonl",)))


@pytest.mark.parametrize("name, refused", [
    ("credentials", True), ("credentials.json", True), (".env.local", True), ("id_ed25519", True),
    ("server.pem", True), ("tls.key", True), ("cert.p12", True), (".netrc", True), (".npmrc", True),
    (".pypirc", True), (".aws/config", True), (".ssh/known_hosts", True), (".kube/config", True),
    ("HF_TOKEN", True), ("github-token.txt", True), ("sub/secrets.yaml", True),
    ("tokenizer.json", False), ("special_tokens_map.json", False), ("id_rsa.pub", False), ("reward.py", False),
    ("keys.py", False), ("data/train.jsonl", False)])
def test_credential_names(name: str, refused: bool):
    assert bool(credential_problems([Entry(name, Path(name), 1, (0, 0))])) == refused


def test_a_private_key_inside_any_file_is_refused_and_a_named_one_goes(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("my key:\n-----BEGIN RSA PRIVATE KEY-----\nMIIE\n")
    (tmp_path / "reward.py").write_text("def reward_fn(r, a, e):\n    return 0.0\n")
    with pytest.raises(WorkdirError, match=r"notes.txt looks like a credential \(a private key inside\).*"
                                           r"--include-secret notes.txt"):
        select(tmp_path, "wd")
    found, data = select(tmp_path, "wd", Selection(include_secrets=("./notes.txt",)))
    assert sorted(data) == ["notes.txt", "reward.py"]
    with pytest.raises(WorkdirError, match=r"--include-secret nope: no such file is sent from wd"):
        select(tmp_path, "wd", Selection(include_secrets=("nope",)))


def test_links_that_stay_inside_but_reach_git_or_nothing_are_refused(tmp_path: Path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text('[remote "origin"]\n  url = https://user:pat@example.com/r\n')
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a\n")
    (tmp_path / "git-config").symlink_to(".git/config")
    (tmp_path / "gone").symlink_to("missing.txt")
    (tmp_path / "latest").symlink_to("data")
    with pytest.raises(WorkdirError) as err:
        select(tmp_path, "wd")
    problems = str(err.value).split("\n  - ")[1:]
    assert [p.split(" (")[0] for p in problems] == [
        "git-config -> .git/config points into .git, which is never sent", "gone -> missing.txt points to nothing"]
    found, data = select(tmp_path, "wd", Selection(excludes=("/git-config", "gone")))
    assert sorted(data) == ["data/a.txt"] and found.skipped == ["latest -> data (a link to a directory: not followed)"]


def test_tool_files_are_sent_and_their_paths_rewritten(workdir: Path):
    doc = job_doc(rollout={"tools": {"functions": [{"file": "wd/reward.py", "function": "reward_fn"}]}})
    packed = pack(copy.deepcopy(doc), validate_job(copy.deepcopy(doc)), Path("wd"), workdir.parent, "ns1")
    assert packed.moved["spec.rollout.tools.functions[0].file"] == f"{WORKDIR_MOUNT}/reward.py"
    assert validate_job(copy.deepcopy(packed.doc)).spec.rollout.tools.functions[0].file == f"{WORKDIR_MOUNT}/reward.py"


def test_an_mcp_server_script_is_sent_and_its_path_rewritten(workdir: Path):
    doc = job_doc(rollout={"tools": {"mcpServers": [{"name": "calc", "command": ["python", "-u", "wd/reward.py"]}]}})
    packed = pack(copy.deepcopy(doc), validate_job(copy.deepcopy(doc)), Path("wd"), workdir.parent, "ns1")
    assert {k: v for k, v in packed.moved.items() if "mcp" in k} == {
        "spec.rollout.tools.mcpServers[0].command[2]": f"{WORKDIR_MOUNT}/reward.py"}
    [server] = validate_job(copy.deepcopy(packed.doc)).spec.rollout.tools.mcp_servers
    assert server.command == ["python", "-u", f"{WORKDIR_MOUNT}/reward.py"]


def test_an_agent_script_is_sent_and_its_path_rewritten(workdir: Path):
    doc = job_doc(rollout={"agent": {"command": ["python", "-u", "wd/reward.py", "--turns", "3"]}})
    packed = pack(copy.deepcopy(doc), validate_job(copy.deepcopy(doc)), Path("wd"), workdir.parent, "ns1")
    assert {k: v for k, v in packed.moved.items() if "agent" in k} == {
        "spec.rollout.agent.command[2]": f"{WORKDIR_MOUNT}/reward.py"}  # not the program, nor the flags
    command = validate_job(copy.deepcopy(packed.doc)).spec.rollout.agent.command
    assert command == ["python", "-u", f"{WORKDIR_MOUNT}/reward.py", "--turns", "3"]

