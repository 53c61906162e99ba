"""LoRA (models/lora.py) against peft's own code: the merged weights we compute equal
peft's `merge()`, the reference (adapters off) is the base model, the adapter export loads
with `PeftModel.from_pretrained`, the seeded start is the same in every layout, and the
spec's errors name the field."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_contract.api import validate_job
from rlhf_contract.api.load import JobError
from rlhf_contract.api.models import LoraSpec
from rlhf_trainer.models.builtin import build_tiny_qwen2
from rlhf_trainer.models.lora import (AdaptersOff, add_adapters, file_key, init_adapters, initial_adapters,
                                      merged_tensors, save_adapter, trainable_parameters)

IDS = torch.tensor([[3, 4, 5, 13, 6, 7, 8, 1, 9, 10]])


def _with_adapters(spec: LoraSpec | None = None, seed: int = 0) -> torch.nn.Module:
    """The tiny model with adapters whose B is not zero (so the adapters change the output)."""
    model = add_adapters(build_tiny_qwen2(), spec or LoraSpec(rank=4, alpha=8))
    init_adapters(model, seed)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_adapters_train_and_every_linear_layer_but_the_head_has_one():
    model = add_adapters(build_tiny_qwen2(), LoraSpec(rank=8))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # 2 layers x (q, k, v, o, gate, up, down), an A and a B each; lm_head and embeddings frozen
    assert len(trained) == 2 * 7 * 2
    assert not any(n.startswith(("lm_head", "model.embed_tokens")) for n in trained)
    full = sum(p.numel() for p in build_tiny_qwen2().parameters())
    assert trainable_parameters(model) == sum(p.numel() for n, p in model.named_parameters() if n in trained) < full / 4


def test_merged_weights_equal_peft_merge_and_score_like_the_adapted_model():
    model = _with_adapters()
    specs, tensors = merged_tensors(model, model.state_dict().items())
    merged = {name: t for (name, _, _), t in zip(specs, tensors)}
    plain = build_tiny_qwen2()
    assert set(merged) == set(plain.state_dict())  # Hugging Face names, no adapter left
    assert [list(t.shape) for t in merged.values()] == [s for _, s, _ in specs]
    oracle = copy.deepcopy(model)
    from peft.tuners.lora import LoraLayer

    for module in oracle.modules():
        if isinstance(module, LoraLayer):
            module.merge()  # peft's own merge, in place
    want = {file_key(k): v for k, v in oracle.state_dict().items() if file_key(k) is not None}
    moved = 0
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=1e-6)
        moved += not torch.equal(tensor, plain.state_dict()[name])
    assert moved == 14  # every wrapped weight changed, nothing else
    plain.load_state_dict(merged)
    torch.testing.assert_close(_logits(plain.eval()), _logits(model), rtol=1e-5, atol=1e-5)


def test_the_reference_is_the_base_model():
    model = _with_adapters()
    base = build_tiny_qwen2().eval()
    assert not torch.allclose(_logits(model), _logits(base), atol=1e-3)
    torch.testing.assert_close(_logits(AdaptersOff(model)), _logits(base), rtol=0, atol=1e-6)
    assert not torch.allclose(_logits(model), _logits(base), atol=1e-3)  # switched back on
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


def test_the_start_is_the_base_and_the_same_from_the_seed():
    a, b = add_adapters(build_tiny_qwen2(), LoraSpec(rank=4)), add_adapters(build_tiny_qwen2(), LoraSpec(rank=4))
    init_adapters(a, 7)
    with torch.device("meta"):  # a sharded run draws them from the meta model's shapes
        meta = add_adapters(build_tiny_qwen2(), LoraSpec(rank=4))
    values = initial_adapters(meta, 7)
    for name, p in a.named_parameters():
        if name in values:
            assert torch.equal(p, values[name])
    init_adapters(b, 8)
    a_names = [n for n in values if ".lora_A." in n]
    assert all(float(values[n].abs().sum()) > 0 for n in a_names)
    assert not torch.equal(dict(a.named_parameters())[a_names[0]], dict(b.named_parameters())[a_names[0]])
    assert all(not values[n].any() for n in values if ".lora_B." in n)  # B = 0: the policy starts as the base
    torch.testing.assert_close(_logits(a.eval()), _logits(build_tiny_qwen2().eval()), rtol=0, atol=0)


def test_the_adapter_export_loads_with_peft(tmp_path):
    from peft import PeftModel

    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = _with_adapters(spec)
    base_dir = tmp_path / "base"
    build_tiny_qwen2().save_pretrained(base_dir)
    save_adapter(tmp_path / "adapter", model, spec, str(base_dir))
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter").eval()
    assert loaded.peft_config["default"].target_modules == {"q_proj", "v_proj", "down_proj"}
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=1e-6)
    torch.testing.assert_close(_logits(loaded.merge_and_unload()), _logits(model), rtol=1e-5, atol=1e-5)


def test_targets_that_match_nothing_or_no_linear_layer_name_the_field():
    with pytest.raises(ValueError, match="model.lora.targetModules.*matched no layer"):
        add_adapters(build_tiny_qwen2(), LoraSpec(target_modules=["no_such_proj"]))
    with pytest.raises(ValueError, match="model.lora.targetModules.*not linear"):
        add_adapters(build_tiny_qwen2(), LoraSpec(target_modules=["embed_tokens"]))


def _job(**model) -> dict:
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "j"},
            "spec": {"model": {"path": "builtin://tiny-qwen2", **model}, "data": {"path": "builtin://last-digit"},
                     "reward": {"type": "exact_match"}, "trainer": {"nprocPerNode": 2}}}


def test_the_spec_refuses_bad_adapters_naming_the_field():
    job = validate_job(_job(lora={"rank": 8}))
    assert job.spec.model.lora.target_modules == ["all-linear"] and job.spec.model.lora.alpha == 32
    with pytest.raises(JobError, match="model.lora.rank"):
        validate_job(_job(lora={"rank": 0}))
    with pytest.raises(JobError, match="model.lora.dropout"):
        validate_job(_job(lora={"dropout": 1.0}))
    with pytest.raises(JobError, match="trainer.parallelism.tensorParallel.*model.lora"):
        validate_job(_job(lora={"rank": 8}), ["trainer.parallelism.tensorParallel=2"])


def test_the_output_head_gets_no_adapter():
    with pytest.raises(ValueError, match="model.lora.targetModules: the output head"):
        add_adapters(build_tiny_qwen2(), LoraSpec(target_modules=["q_proj", "lm_head"]))


def test_a_score_models_head_trains_whole_beside_the_adapters(tiny_model_dir):
    """method rm: the new score head is excluded from all-linear and trains whole; the
    merged export keeps its name (`score.weight`), as the sequence classifier expects."""
    from rlhf_trainer.models.score import ScoreModel

    model = add_adapters(ScoreModel(str(tiny_model_dir), 0), LoraSpec(rank=4))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "score.weight" in trained and not any(n.startswith("score.") and ".lora_" in n for n in trained)
    assert all(n == "score.weight" or ".lora_" in n for n in trained)
    specs, _ = merged_tensors(model, model.state_dict().items())
    assert "score.weight" in [name for name, _, _ in specs]
    assert not any("lora" in name or "base_layer" in name for name, _, _ in specs)
