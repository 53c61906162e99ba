"""`rlhfctl submit --working-dir`: a directory into ConfigMaps and the job rewritten to mount
them (rlhf_launcher/workdir.py). The files a pod would see are rebuilt from the manifests as
the kubelet projects them (each source's items, `data` as text, `binaryData` base64), and the
job must pass the operator's own pod-settings check."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import pytest
import yaml

from rlhf_contract.api import validate_job
from rlhf_launcher.cli import main
from rlhf_launcher.workdir import (
    CONFIGMAP_BYTES, MAX_CONFIGMAPS, MIB, WORKDIR_MOUNT, WORKDIR_VOLUME, WorkdirError, left_behind, pack,
)
from rlhf_operator.builders.pods import PodSettings, PodSettingsError

KEY = __import__("re").compile(r"^[-._a-zA-Z0-9]+$")  # the API server's ConfigMap key rule


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
    from rlhf_trainer.rewards.forms import load_reward_function

    root = Path(__file__).resolve().parents[2]
    job = validate_job(yaml.safe_load((root / "examples" / "cluster-custom-reward.yaml").read_text()))
    fn = load_reward_function(str(root / job.spec.reward.file), job.spec.reward.function)
    assert fn(r"so \boxed{4}", "4", {}) == (1.1, 1.0)
    assert fn(r"\boxed{3} or \boxed{ 5 }", "5", {}) == (1.1, 1.0)
    assert fn("4", "4", {}) == (0.0, 0.0)
