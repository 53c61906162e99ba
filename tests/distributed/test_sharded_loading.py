"""Sharded loading (models/loading.py) gives every rank exactly the checkpoint's weights,
holding only its shard: FSDP, TP and CP over 2 gloo processes against a plain
single-process `from_pretrained`, for an untied fp32 model, a tied one and one stored in
bf16 across several safetensors shards; and the final export (`save_final`), streamed
into safetensors shards from the sharded model, reads back as the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import torchrun

WORKER = Path(__file__).parent / "workers" / "sharded_loading.py"
LAYOUTS = ["2,1,1", "1,2,1", "1,1,2"]


def save_models(root: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    for name, tie, dtype, shard in [("untied-fp32", False, torch.float32, None),
                                    ("tied-fp32", True, torch.float32, None),
                                    ("untied-bf16-sharded", False, torch.bfloat16, "20KB")]:
        torch.manual_seed(len(name))
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=tie, **base)).to(dtype)
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(root / name, **kwargs)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    save_models(root)
    assert len(list((root / "untied-bf16-sharded").glob("*.safetensors"))) > 1  # really sharded
    out = root.parent / "sharded_loading.json"
    return torchrun(WORKER, 2, "--models-dir", str(root), *LAYOUTS, out=out, timeout=300,
                    env={"EXPORT_ROOT": str(root.parent / "exports")})


@pytest.mark.parametrize("model", ["untied-fp32", "tied-fp32", "untied-bf16-sharded"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["fsdp2", "tp2", "cp2"])
def test_sharded_loading_equals_plain_loading(results, model, layout):
    r = results[model][layout]
    assert r["param_max_abs_err"] == 0.0  # bit-exact (bf16 -> fp32 is exact)
    assert r["buffers_equal"]  # rotary frequencies rebuilt, not left as empty storage
    assert r["dtype"] == "torch.float32"  # master weights in fp32 whatever the stored dtype
    assert r["logits_max_abs_err"] < 1e-5
    assert r["tied"] == model.startswith("tied")
    export = r["export"]  # final/ written by save_final, read by from_pretrained
    assert export["max_abs_err"] == 0.0 and export["tied"] == model.startswith("tied")
    assert export["files"] > 1  # streamed into several safetensors shards (with an index)
    # written in the dtype the source checkpoint declared (the trainer holds fp32 master weights)
    assert export["stored_dtypes"] == ["torch.bfloat16" if "bf16" in model else "torch.float32"]
    if layout != "1,1,2":  # FSDP and TP shard every matrix (CP alone replicates)
        assert r["largest_local_fraction"] <= 0.5
