"""The gradient norm under FSDP, TP, CP and their products on 4 gloo processes equals the
norm of the whole gradients, with one all-reduce per process group (not per parameter),
and clipping and a NaN on one rank behave. One torchrun launch runs every layout
(`workers/grad_norm_collectives.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import torchrun

WORKER = Path(__file__).parent / "workers" / "grad_norm_collectives.py"
GROUPS = {  # layout (dp_shard,tp,cp) -> distinct process groups the gradients are sharded over
    "4,1,1": 1,  # FSDP: dp
    "2,1,2": 1,  # FSDP over the flattened dp x cp
    "1,4,1": 1,  # TP: tp (norms are plain tensors, the embedding's gradient is replicated)
    "2,2,1": 2,  # FSDP over TP: dp and tp (2-D mesh, _StridedShard on dp for column-parallel weights)
    "1,2,2": 2,  # FSDP over cp, TP
    "synthetic": 2,  # hand-placed gradients on a 2 x 2 mesh, Replicate on either dimension
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return torchrun(WORKER, 4, *GROUPS, out=tmp_path_factory.mktemp("grad_norm") / "world4.json", timeout=240)


@pytest.mark.parametrize("layout", list(GROUPS))
def test_norm_equals_the_whole_gradients_norm(results, layout):
    r = results[layout]
    assert r["norm"] == pytest.approx(r["ref"], rel=1e-5)
    assert r["ref"] > 1.0


@pytest.mark.parametrize("layout", list(GROUPS))
def test_one_all_reduce_per_process_group(results, layout):
    r = results[layout]
    assert r["collectives"] == GROUPS[layout]
    # the per-parameter way made each of these whole on its own (27 collectives under FSDP)
    assert r["dtensor_grads"] >= (5 if layout == "synthetic" else 20)


def test_layouts_have_the_placements_they_claim(results):
    assert results["4,1,1"]["placements"] == ["Shard"]
    assert set(results["1,4,1"]["placements"]) == {"Shard", "Replicate", "Tensor"}
    assert results["1,4,1"]["plain_grads"] == 5  # 2 x 2 layer norms + the final norm
    assert "_StridedShard,Shard" in results["2,2,1"]["placements"]
    assert "Shard,Shard" in results["2,2,1"]["placements"]


@pytest.mark.parametrize("layout", [k for k in GROUPS if k != "synthetic"])
def test_clipping_scales_to_the_max_norm(results, layout):
    r = results[layout]
    assert r["clipped_norm"] == pytest.approx(r["ref"], rel=1e-5)  # the norm before clipping
    assert r["after_clip"] == pytest.approx(r["max_norm"], rel=1e-5)  # max_norm = ref / 2


@pytest.mark.parametrize("layout", [k for k in GROUPS if k != "synthetic"])
def test_nan_on_one_rank_is_seen_by_every_rank(results, layout):
    assert results[layout]["finite_after_nan"] == [0.0, 0.0, 0.0, 0.0]
