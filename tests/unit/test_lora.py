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


# ---- model.lora.modulesToSave: modules that train whole beside the adapters -------------

HEAD = LoraSpec(rank=4, alpha=8, modules_to_save=["lm_head"])


def _with_trained_head() -> torch.nn.Module:
    """Adapters that change the output (B != 0) and a trained head copy unlike the base's."""
    model = _with_adapters(HEAD)
    with torch.no_grad():
        model.lm_head.modules_to_save["default"].weight.mul_(3.0).add_(0.1)
    return model


def test_a_module_to_save_trains_whole_and_the_reference_keeps_the_original():
    model = add_adapters(build_tiny_qwen2(), HEAD)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained - {n for n in trained if ".lora_" in n} == {"lm_head.modules_to_save.default.weight"}
    assert len(trained) == 2 * 7 * 2 + 1
    vocab, hidden = model.lm_head.original_module.weight.shape
    assert trainable_parameters(model) == trainable_parameters(add_adapters(build_tiny_qwen2(), LoraSpec(rank=4))) \
        + vocab * hidden
    model = _with_trained_head()
    base = build_tiny_qwen2().eval()
    torch.testing.assert_close(_logits(AdaptersOff(model)), _logits(base), rtol=0, atol=1e-6)
    assert not torch.allclose(_logits(model), _logits(_with_adapters()), atol=1e-3)  # the trained head computes
    assert model.lm_head.modules_to_save["default"].weight.requires_grad  # switching off changed no flag


def test_the_logprob_head_reads_the_trained_copy_and_the_reference_the_original():
    from rlhf_trainer.models.logprob_head import attach_logprob_head, request_stats

    model = _with_trained_head()
    want = {}
    for name, m in (("policy", model), ("reference", AdaptersOff(model))):
        want[name] = torch.log_softmax(_logits(m)[0, :-1], -1).gather(-1, IDS[0, 1:, None])[:, 0]
    attach_logprob_head(model)
    for name, m in (("policy", model), ("reference", AdaptersOff(model))):
        request_stats(model, IDS[:, 1:], 1.0, entropy="none")
        stats = _logits(m, IDS[:, :-1])
        torch.testing.assert_close(stats[0, :, 0], want[name], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want["policy"], want["reference"], atol=1e-3)


def test_the_merged_model_holds_the_trained_head_under_its_own_name():
    model = _with_trained_head()
    specs, tensors = merged_tensors(model, model.state_dict().items())
    merged = {name: t for (name, _, _), t in zip(specs, tensors)}
    plain = build_tiny_qwen2()
    assert set(merged) == set(plain.state_dict())
    assert torch.equal(merged["lm_head.weight"], model.lm_head.modules_to_save["default"].weight)
    plain.load_state_dict(merged)
    torch.testing.assert_close(_logits(plain.eval()), _logits(model), rtol=1e-5, atol=1e-5)


def test_a_sharded_start_reads_both_head_copies_from_the_base_file():
    with torch.device("meta"):
        meta = add_adapters(build_tiny_qwen2(), HEAD)
    keys = {k: file_key(k) for k in meta.state_dict() if "lm_head" in k}
    assert keys == {"lm_head.original_module.weight": "lm_head.weight",
                    "lm_head.modules_to_save.default.weight": "lm_head.weight"}
    assert not any("lm_head" in k for k in initial_adapters(meta, 0))


def test_the_adapter_export_with_a_trained_head_loads_with_peft(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = _with_trained_head()
    base_dir = tmp_path / "base"
    build_tiny_qwen2().save_pretrained(base_dir)
    save_adapter(tmp_path / "adapter", model, HEAD, str(base_dir))
    assert "base_model.model.lm_head.weight" in load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter").eval()
    assert loaded.peft_config["default"].modules_to_save == ["lm_head"]
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=1e-6)
    torch.testing.assert_close(_logits(loaded.merge_and_unload()), _logits(model), rtol=1e-5, atol=1e-5)


def test_modules_to_save_that_match_nothing_or_a_tied_embedding_name_the_field():
    from transformers import Qwen2ForCausalLM

    with pytest.raises(ValueError, match="model.lora.modulesToSave: 'no_such_head' matched no module"):
        add_adapters(build_tiny_qwen2(), LoraSpec(modules_to_save=["no_such_head"]))
    config = copy.deepcopy(build_tiny_qwen2().config)
    config.tie_word_embeddings = True
    tied = Qwen2ForCausalLM(config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    for name in ("lm_head", "embed_tokens"):
        with pytest.raises(ValueError, match=f"model.lora.modulesToSave: '{name}' holds an embedding tied"):
            add_adapters(copy.deepcopy(tied), LoraSpec(modules_to_save=[name]))


def test_the_spec_takes_modules_to_save_in_camel_case():
    job = validate_job(_job(lora={"rank": 8, "modulesToSave": ["lm_head"]}))
    assert job.spec.model.lora.modules_to_save == ["lm_head"]
    assert validate_job(_job(lora={"rank": 8})).spec.model.lora.modules_to_save == []
