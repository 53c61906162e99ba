"""Checkpoints that were planted or cut short (issue 49): a COMPLETE cut mid-write counts
as incomplete and the one before is resumed; an `rng-rank*.pt` or DCP `.metadata` whose
pickle would run code is refused, never executed, and the checkpoint set aside. Real
checkpoints written by `save_checkpoint` in a one-process gloo group."""

from __future__ import annotations

import json
import os
import pickle
import random

import pytest
import torch
import torch.distributed as dist

from rlhf_contract.outputs import MARKER
from rlhf_trainer.checkpoint import CheckpointError, load_checkpoint, resume_checkpoint, save_checkpoint


class Planted:
    """What a bucket writer plants: unpickling it runs a command."""

    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


class Part:
    """A trained part with a DCP state (one tensor), as an engine gives it."""

    def __init__(self, value: float):
        self.weight = torch.full((4,), value)

    def dcp_state(self):
        return {"model": {"weight": self.weight}}

    def load_dcp_state(self, state):
        self.weight = state["model"]["weight"]

    def save_files(self, directory, tag):
        pass

    def load_files(self, directory, tag):
        pass


@pytest.fixture(autouse=True)
def one_process_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def save(out, step, value):
    return save_checkpoint(out, step, {"policy": Part(value)}, {"data_position": step * 10}, keep=5)


def test_a_marker_cut_mid_write_falls_back_to_the_previous_checkpoint(tmp_path):
    save(tmp_path, 2, 2.0)
    newest = save(tmp_path, 4, 4.0)
    marker = newest / MARKER
    assert json.loads(marker.read_text())["files"]  # written whole: it lists the checkpoint's files
    assert not [p for p in newest.iterdir() if p.name.endswith(".tmp")]  # no temporary file left
    marker.write_text(marker.read_text()[: len(marker.read_text()) // 2])  # what a crash mid-write left
    chosen = resume_checkpoint(tmp_path)
    assert chosen == tmp_path / "checkpoints" / "step-2"
    assert (tmp_path / "checkpoints" / "damaged-step-4").is_dir()
    part = Part(0.0)
    assert load_checkpoint(chosen, {"policy": part}) == {"data_position": 20, "step": 2}
    assert part.weight.tolist() == [2.0] * 4


def test_an_empty_marker_is_incomplete_too(tmp_path):
    save(tmp_path, 1, 1.0)
    (save(tmp_path, 3, 3.0) / MARKER).write_text("")
    assert resume_checkpoint(tmp_path).name == "step-1"


def test_rng_state_round_trips_through_weights_only(tmp_path):
    random.seed(7)
    torch.manual_seed(7)
    path = save(tmp_path, 1, 1.0)
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    load_checkpoint(path, {"policy": Part(0.0)})
    got = (random.random(), torch.rand(3))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


def test_a_planted_rng_pickle_is_refused_not_executed(tmp_path):
    save(tmp_path, 2, 2.0)
    planted = save(tmp_path, 4, 4.0)
    sentinel = tmp_path / "code-ran"
    torch.save({"torch": torch.get_rng_state(), "python": Planted(sentinel)}, planted / "rng-rank0.pt")
    (planted / MARKER).write_text(json.dumps({"files": {p.name: p.stat().st_size for p in planted.iterdir()
                                                       if p.is_file() and p.name != MARKER}}))
    with pytest.raises(CheckpointError) as err:  # loaded directly: refused
        load_checkpoint(planted, {"policy": Part(0.0)})
    assert "rng-rank0.pt is refused" in str(err.value) and "posix.system" in str(err.value)
    assert resume_checkpoint(tmp_path).name == "step-2"  # at resume: set aside, the one before used
    assert (tmp_path / "checkpoints" / "damaged-step-4" / "rng-rank0.pt").exists()
    assert not sentinel.exists()


def test_a_planted_dcp_metadata_pickle_is_refused_not_executed(tmp_path):
    save(tmp_path, 2, 2.0)
    planted = save(tmp_path, 4, 4.0)
    sentinel = tmp_path / "code-ran"
    (planted / ".metadata").write_bytes(pickle.dumps(Planted(sentinel)))
    (planted / MARKER).write_text(json.dumps({"files": {}}))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(planted, {"policy": Part(0.0)})
    assert "metadata is not DCP's" in str(err.value)
    assert resume_checkpoint(tmp_path).name == "step-2"
    assert not sentinel.exists()


def test_rlhfctl_export_refuses_a_planted_dcp_metadata_pickle(tmp_path):
    from rlhf_launcher.export import ExportError, export_checkpoint

    planted = save(tmp_path, 2, 2.0)
    sentinel = tmp_path / "code-ran"
    (planted / ".metadata").write_bytes(pickle.dumps(Planted(sentinel)))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8,
                                                                "num_attention_heads": 2, "vocab_size": 8}))
    with pytest.raises(ExportError, match="is refused: a file in it is not plain data"):
        export_checkpoint(planted, tmp_path / "exported", model=str(tmp_path / "model"))
    assert not sentinel.exists()


def _zero_engine(stage: int):
    import deepspeed

    from rlhf_trainer.engine.zero import ZeroEngine

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    ds, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config=config, dist_init_required=False)
    return ZeroEngine(model, ds, 1)


def test_deepspeed_files_are_read_back_as_data_and_a_planted_one_never_runs(tmp_path, monkeypatch, stage=2):
    """DeepSpeed asks torch.load for weights_only=False; ZeroEngine.load_files and
    `rlhfctl export` hold it to data (DeepSpeed's own plain classes allowed). ZeRO-3's files
    (one process here: DeepSpeed keeps its groups across process groups) are read back the
    same way by tests/e2e/test_deepspeed_runs.py's resume and export."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from rlhf_trainer.engine.zero import data_only_loads

    for k, v in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    engine = _zero_engine(stage)
    loss = engine.ds(torch.ones(1, 8, dtype=torch.bfloat16)).float().sum()
    engine.ds.backward(loss)
    engine.ds.step()
    engine.save_files(tmp_path, "policy")
    before = {k: v.clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="policy").items()}

    fresh = _zero_engine(stage)
    fresh.load_files(tmp_path, "policy")  # every file DeepSpeed wrote reads as data
    with data_only_loads():
        after = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="policy")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    sentinel = tmp_path / "code-ran"
    states = next((tmp_path / "policy").glob("*model_states.pt"))
    torch.save({**torch.load(states, weights_only=False), "planted": Planted(sentinel)}, states)
    with pytest.raises(pickle.UnpicklingError):
        _zero_engine(stage).load_files(tmp_path, "policy")
    with pytest.raises(pickle.UnpicklingError), data_only_loads():
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="policy")
    assert not sentinel.exists()
    assert torch.load is not None and torch.load.__name__ == "load"  # restored after each use


class _EnumsByGetattr(pickle.Pickler):
    """Pickles Enum members as Python 3.11.2 does (`getattr(cls, name)`), and lets a test plant
    a getattr of something else."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if isinstance(obj, Planted):
            return getattr, (torch.Size, "__init__")
        return NotImplemented


def test_dcp_metadata_with_enums_pickled_by_getattr_reads_and_other_getattrs_do_not(tmp_path):
    """The trainer image's Python (Debian's 3.11.2) pickles DCP's Enum members through
    `getattr`: such metadata reads; a getattr of anything but an Enum member is refused."""
    import io

    from rlhf_trainer.checkpoint import SafeReader

    planted = save(tmp_path, 2, 2.0)
    metadata = SafeReader(planted).read_metadata()
    buf = io.BytesIO()
    _EnumsByGetattr(buf).dump(metadata)
    assert b"getattr" in buf.getvalue()  # the form the image's Python writes
    (planted / ".metadata").write_bytes(buf.getvalue())
    again = SafeReader(planted).read_metadata()
    assert again.state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    assert load_checkpoint(planted, {"policy": Part(0.0)})["data_position"] == 20

    buf = io.BytesIO()
    _EnumsByGetattr(buf).dump({"x": Planted(tmp_path / "never")})
    (planted / ".metadata").write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError, match=r"getattr\(Size, '__init__'\) is not allowed"):
        load_checkpoint(planted, {"policy": Part(0.0)})
