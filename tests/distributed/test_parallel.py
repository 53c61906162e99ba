"""FSDP, TP, CP, their combinations and activation checkpointing under torchrun + gloo
give the loss and gradients of one process forwarding each document on its own.

One torchrun launch per world size runs every layout (`workers/parallel_parity.py`);
each test checks one layout's numbers. The data: 8 documents of 3-12 tokens, packed
into micro-batches of at most 20 tokens, balanced over the data-parallel ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import torchrun

WORKER = Path(__file__).parent / "workers" / "parallel_parity.py"
TOL = 1e-5  # float32, relative (loss) and relative L2 per parameter gradient (worst one)

LAYOUTS = {  # world size -> "dp_shard,tp,cp[,ac]"
    2: ["2,1,1", "1,2,1", "1,1,2", "2,1,1,ac", "1,1,2,ac", "1,2,1,llama", "1,1,2,llama"],
    4: ["2,2,1", "2,1,2", "1,2,2", "2,2,1,ac", "2,2,1,llama"],
}




def launch(world: int, tmp_path: Path) -> dict:
    return torchrun(WORKER, world, *LAYOUTS[world], out=tmp_path / f"world{world}.json", timeout=240)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict:
    return launch(2, tmp_path_factory.mktemp("parallel2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    return launch(4, tmp_path_factory.mktemp("parallel4"))


def check(result: dict, *, checkpointed: bool = False) -> None:
    assert result["family"] in ("qwen2", "llama")
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=TOL)
    assert result["ref_loss"] > 1.0  # a real loss (about ln 16 for random weights), not 0
    assert result["grad_rel_err"] < TOL, f"worst gradient: {result['worst']}"
    assert result["names_match"]  # Hugging Face parameter names survive every wrapper
    assert result["mlp_calls"] == result["passes"] * (2 if checkpointed else 1)


@pytest.mark.parametrize("layout", ["2,1,1", "1,2,1", "1,1,2"], ids=["fsdp2", "tp2", "cp2"])
def test_one_dimension_matches_single_process(world2, layout):
    check(world2[layout])


@pytest.mark.parametrize("layout", ["2,1,1,ac", "1,1,2,ac"], ids=["fsdp2", "cp2"])
def test_activation_checkpointing_matches_single_process(world2, layout):
    check(world2[layout], checkpointed=True)


@pytest.mark.parametrize("layout", ["2,2,1", "2,1,2", "1,2,2", "2,2,1,ac"],
                         ids=["fsdp2xtp2", "fsdp2xcp2", "cp2xtp2", "fsdp2xtp2-ac"])
def test_two_dimensions_match_single_process(world4, layout):
    check(world4[layout], checkpointed=layout.endswith("ac"))


@pytest.mark.parametrize(("world", "layout"), [(2, "1,2,1,llama"), (2, "1,1,2,llama"), (4, "2,2,1,llama")],
                         ids=["tp2", "cp2", "fsdp2xtp2"])
def test_llama_family_matches_single_process(request, world, layout):
    result = request.getfixturevalue(f"world{world}")[layout]
    assert result["family"] == "llama"
    check(result)


def test_sizes_must_multiply_to_the_world_size():
    from rlhf_trainer.parallel.parallelize import build_mesh

    with pytest.raises(ValueError, match=r"trainer\.parallelism: dp_shard \(2\) x tp \(2\) x cp \(1\) = 4 "
                                         r"must equal the number of trainer processes \(2\)"):
        build_mesh(world_size=2, dp_shard=2, tp=2, cp=1, device_type="cpu")
