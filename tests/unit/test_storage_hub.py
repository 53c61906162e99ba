"""`hf://` with the Hub's own semantics, against a real Hub-protocol server (olah): a
dataset repository's configs and splits (only the chosen config's split is downloaded and
read, as `datasets.load_dataset` reads the repository), a file or folder inside a dataset
repository, a model repository whose download takes only what `from_pretrained` reads (no
`original/`, no `.bin` duplicates, no gguf / onnx / flax weights: checked on disk and in the
requests the server saw), a bare Hub id answered with the `hf://` form, and `rlhfctl plan`
reading an `hf://` model's config.json alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from rlhf_contract.api import validate_job
from rlhf_contract.sources import Fetch, plan
from rlhf_trainer.data.datasets import load_records, peek_records
from storage_servers import Served, files_of, forward, run_step

GSM_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*.jsonl
  - split: test
    path: socratic/test-*.jsonl
---
# A gsm8k-shaped repository: two configs, each with its own files
"""


def job(data: dict, model: str = "builtin://tiny-qwen2") -> object:
    return validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "hub"},
                         "spec": {"model": {"path": model}, "data": data}})


@pytest.fixture(scope="module")
def gsm(hub_server, tmp_path_factory):
    """org/gsm: config `main` in Parquet, `socratic` in JSON Lines, train and test each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("gsm")
    for split in ("train", "test"):
        (root / "main").mkdir(exist_ok=True)
        rows = [{"question": f"main-{split}-{i}", "answer": str(i)} for i in range(6)]
        pq.write_table(pa.Table.from_pylist(rows), root / "main" / f"{split}-00000-of-00001.parquet")
        (root / "socratic").mkdir(exist_ok=True)
        (root / "socratic" / f"{split}-00000-of-00001.jsonl").write_text("".join(
            json.dumps({"question": f"socratic-{split}-{i}", "answer": str(i)}) + "\n" for i in range(4)))
    (root / "README.md").write_text(GSM_CARD)
    hub_server.add_repo("org/gsm", root, kind="dataset")
    return hub_server


def test_a_dataset_repository_is_read_for_its_config_and_split_only(gsm, tmp_path, tiny_model_dir):
    from rlhf_contract.sources import localize
    from rlhf_contract.trainer_config import TrainerConfig
    from rlhf_trainer.data.prompts import PromptSource
    from transformers import AutoTokenizer

    spec = job({"path": "hf://org/gsm", "config": "main", "promptKey": "question"})
    fetch, = plan(spec, str(tmp_path))
    assert (fetch.config, fetch.split) == ("main", "train") and fetch.local.endswith("hf/datasets/org/gsm/main+main.train")
    proc = run_step([fetch], {"HF_ENDPOINT": gsm.endpoint})
    assert proc.returncode == 0, proc.stderr
    assert sorted(files_of(Path(fetch.local))) == ["README.md", "main/train-00000-of-00001.parquet"]
    rows = load_records(fetch.reads(), split="train", config="main")
    assert [r["question"] for r in rows] == [f"main-train-{i}" for i in range(6)]  # not socratic's, not test's
    sample = peek_records(fetch.reads(), split="train", config="main", limit=2)
    assert sample.num_rows == 6 and sample.columns == ["question", "answer"]
    data = TrainerConfig.from_job(localize(spec, str(tmp_path))).data  # what the trainer reads, as it reads it
    source = PromptSource(data, AutoTokenizer.from_pretrained(tiny_model_dir), seed=0)
    assert (data.path, data.config, source.num_rows) == (fetch.reads(), "main", 6)


@pytest.mark.parametrize("data,says", [
    ({"config": "bogus"}, "spec.data.config: hf://org/gsm has no config 'bogus'; it has main, socratic"),
    ({}, "has several configs (main, socratic) and none is its default; set spec.data.config to one"),
    ({"config": "socratic", "split": "validation"},
     "spec.data.split: hf://org/gsm (config 'socratic') has no split 'validation'; it has train, test"),
])
def test_an_unknown_config_or_split_is_exit_2_naming_the_field(gsm, tmp_path, data, says):
    fetch, = plan(job({"path": "hf://org/gsm", **data}), str(tmp_path))
    proc = run_step([fetch], {"HF_ENDPOINT": gsm.endpoint})
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not Path(fetch.local).exists() and not Path(fetch.marker()).exists()


def test_the_copy_is_read_as_the_repository_is(gsm, tmp_path):
    """The trainer's loader on a copy that holds one config's split: `datasets`' own errors
    for the others, under the spec's field names."""
    fetch, = plan(job({"path": "hf://datasets/org/gsm", "config": "socratic", "split": "test"}), str(tmp_path))
    assert run_step([fetch], {"HF_ENDPOINT": gsm.endpoint}).returncode == 0
    assert [r["question"] for r in load_records(fetch.reads(), split="test", config="socratic")] == [
        f"socratic-test-{i}" for i in range(4)]
    with pytest.raises(ValueError, match="data.config: .* has no config 'nope'; it has main, socratic"):
        load_records(fetch.reads(), split="test", config="nope")
    with pytest.raises(ValueError, match="no files of split 'train' of config 'socratic'"):
        load_records(fetch.reads(), split="train", config="socratic")  # not downloaded: another copy's


def test_two_configs_of_one_commit_are_two_entries_of_the_shared_cache(gsm, tmp_path):
    """spec.sourceCache (cache.py) with a part of a repository: two jobs reading two configs of
    the same commit each get their own config's files, not the copy of whichever came first."""
    cache = tmp_path / "cache"
    copies = {}
    for config in ("main", "socratic"):
        fetch, = plan(job({"path": "hf://org/gsm", "config": config}), str(tmp_path / f"job-{config}"))
        proc = run_step([fetch], {"HF_ENDPOINT": gsm.endpoint}, "--cache", str(cache))
        assert proc.returncode == 0, proc.stderr
        assert Path(fetch.local).is_symlink() and Path(fetch.local).resolve().is_relative_to(cache.resolve())
        copies[config] = Path(fetch.local).resolve()
        rows = load_records(fetch.reads(), split="train", config=config)
        assert [r["question"] for r in rows][:1] == [f"{config}-train-0"]
    assert copies["main"] != copies["socratic"]


def test_a_folder_inside_a_dataset_repository(gsm, tmp_path):
    fetch, = plan(job({"path": "hf://datasets/org/gsm@main/socratic", "split": "test"}), str(tmp_path))
    assert (fetch.config, fetch.split) == (None, None) and fetch.reads() == fetch.local + "/socratic"
    assert run_step([fetch], {"HF_ENDPOINT": gsm.endpoint}).returncode == 0
    assert sorted(files_of(Path(fetch.local))) == ["socratic/test-00000-of-00001.jsonl",
                                                   "socratic/train-00000-of-00001.jsonl"]
    assert [r["question"] for r in load_records(fetch.reads(), split="test")][:2] == ["socratic-test-0", "socratic-test-1"]
    missing, = plan(job({"path": "hf://datasets/org/gsm/no/such.jsonl"}), str(tmp_path / "other"))
    proc = run_step([missing], {"HF_ENDPOINT": gsm.endpoint})
    assert proc.returncode == 2 and "spec.data.path: hf://datasets/org/gsm/no/such.jsonl: no file or folder" in proc.stderr


@pytest.fixture(scope="module")
def llama_like(hub_server, tiny_model_dir, tmp_path_factory):
    """org/dup: the tiny model as sharded safetensors with their index, beside what a Hub
    model repository also carries: `original/` weights, `.bin` duplicates and their index,
    gguf, onnx, flax, a consolidated safetensors the index does not name, a README."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("dup")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.save_pretrained(root, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / name).write_bytes((tiny_model_dir / name).read_bytes())
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    junk = os.urandom(2000)  # not 121-149 bytes (olah's LFS-pointer parser, DESIGN.md)
    for name in ("original/consolidated.00.pth", "original/params.json", "original/tokenizer.model",
                 "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "model.gguf",
                 "onnx/model.onnx", "flax_model.msgpack", "tf_model.h5", "consolidated.safetensors"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(junk)
    (root / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model-00001-of-00002.bin"}}))
    (root / "README.md").write_text("# a model\n")
    hub_server.add_repo("org/dup", root)
    return hub_server, root, model


def test_a_model_download_takes_what_from_pretrained_reads(llama_like, tmp_path):
    server, root, model = llama_like
    seen = Served(lambda handler, body: forward(server.port, handler, body))  # every request the step makes
    try:
        fetch, = plan(job({"path": "builtin://last-digit"}, model="hf://org/dup"), str(tmp_path))
        proc = run_step([fetch], {"HF_ENDPOINT": seen.url})
    finally:
        seen.close()
    assert proc.returncode == 0, proc.stderr
    shards = sorted(p.name for p in root.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert sorted(files_of(Path(fetch.local))) == sorted(
        ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors.index.json",
         "tokenizer.json", "tokenizer_config.json", *shards])
    downloaded = {path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path, _, _ in seen.requests
                  if method == "GET" and "/resolve/" in path}
    assert downloaded == set(files_of(Path(fetch.local)))  # nothing fetched and thrown away
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_pretrained(fetch.local)
    assert all(copy.state_dict()[k].equal(v) for k, v in model.state_dict().items())


def test_a_model_in_a_folder_of_its_repository(llama_like, tiny_model_dir, hub_server, tmp_path):
    root = tmp_path / "repo"
    (root / "checkpoints" / "step-100").mkdir(parents=True)
    for f in tiny_model_dir.iterdir():
        (root / "checkpoints" / "step-100" / f.name).write_bytes(f.read_bytes())
    (root / "checkpoints" / "step-200").mkdir()
    (root / "checkpoints" / "step-200" / "model.safetensors").write_bytes(os.urandom(3000))
    hub_server.add_repo("org/runs", root)
    fetch, = plan(job({"path": "builtin://last-digit"}, model="hf://org/runs/checkpoints/step-100"), str(tmp_path / "o"))
    assert run_step([fetch], {"HF_ENDPOINT": hub_server.endpoint}).returncode == 0
    assert sorted(files_of(Path(fetch.reads()))) == sorted(f.name for f in tiny_model_dir.iterdir() if f.name != ".builtin")
    assert not (Path(fetch.local) / "checkpoints" / "step-200").exists()


def test_a_bare_hub_id_is_answered_with_the_hf_address(tmp_path, capsys, monkeypatch):
    from rlhf_launcher.cli import main
    from rlhf_operator.backends import build_children
    from rlhf_operator.builders.pods import PodSettingsError

    monkeypatch.chdir(tmp_path)  # no such local path here
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "bare"},
                                    "spec": {"model": {"path": "Qwen/Qwen3-0.6B"},
                                             "data": {"path": "openai/gsm8k", "config": "main"}}}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.model.path: 'Qwen/Qwen3-0.6B' is no path here" in err and "write hf://Qwen/Qwen3-0.6B" in err
    assert "spec.data.path: 'openai/gsm8k'" in err and "write hf://openai/gsm8k" in err
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)  # a local directory of that name is a path
    main(["validate", str(path)])
    assert "spec.model.path" not in capsys.readouterr().err
    (tmp_path / "Qwen" / "Qwen3-0.6B").rmdir()
    bare = job({"path": "/data/x.jsonl"}, model="Qwen/Qwen3-0.6B")
    with pytest.raises(PodSettingsError, match="spec.model.path: .* write hf://Qwen/Qwen3-0.6B"):
        build_children(bare, 1)  # the operator: a relative path is on no volume
    from rlhf_launcher.local import LocalRunError, run_local

    with pytest.raises(LocalRunError, match="spec.model.path: .* write hf://Qwen/Qwen3-0.6B"):
        run_local(job({"path": "builtin://last-digit"}, model="Qwen/Qwen3-0.6B"), output=str(tmp_path / "out"))


def test_plan_reads_an_hf_model_config_from_the_hub(llama_like, tmp_path, capsys, monkeypatch):
    from rlhf_launcher.cli import main

    server, _, _ = llama_like
    seen = Served(lambda handler, body: forward(server.port, handler, body))
    monkeypatch.setenv("HF_ENDPOINT", seen.url)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "p"},
                                    "spec": {"model": {"path": "hf://org/dup"}, "data": {"path": "builtin://last-digit"}}}))
    try:
        assert main(["plan", str(path), "--gpu-memory-gib", "80"]) == 0
        assert "fits:" in capsys.readouterr().out
        assert [p for m, p, _, _ in seen.requests if "/resolve/" in p] == [p for m, p, _, _ in seen.requests
                                                                              if p.endswith("/config.json")]
        assert any(p.endswith("/config.json") for _, p, _, _ in seen.requests)
        (tmp_path / "job.yaml").write_text(path.read_text().replace("hf://org/dup", "hf://org/missing"))
        assert main(["plan", str(path), "--gpu-memory-gib", "80"]) == 2
        assert "model.path: cannot read the config.json of hf://org/missing" in capsys.readouterr().err
    finally:
        seen.close()
