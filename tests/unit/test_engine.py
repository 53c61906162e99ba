"""The training-engine seam (trainer_image/rlhf_trainer/engine/) on one CPU process: the
optimizer step's rules, the offload state machine, and that nothing outside the engine
asks which engine trains or whether adapters exist. DeepSpeed against FSDP2, and offload
and reload between steps for both, run on two gloo processes in
tests/distributed/test_engine_parity.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rlhf_contract.api.models import LoraSpec
from rlhf_trainer.engine import EngineStateError, Fsdp2Engine
from rlhf_trainer.models.builtin import build_tiny_qwen2
from rlhf_trainer.models.lora import add_adapters, init_adapters

TRAINER = Path(__file__).resolve().parents[2] / "trainer_image" / "rlhf_trainer"


def engine(lr: float = 1e-2, lora: bool = False) -> Fsdp2Engine:
    model = build_tiny_qwen2(0)
    if lora:
        add_adapters(model, LoraSpec(rank=4))
        init_adapters(model, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    return Fsdp2Engine(model, torch.optim.AdamW(params, lr=lr))


def loss_of(e: Fsdp2Engine) -> torch.Tensor:
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    return e.model(input_ids=ids, labels=ids).loss


def test_a_step_clips_and_updates_and_a_non_finite_norm_skips_it():
    e = engine()
    before = {n: p.detach().clone() for n, p in e.model.named_parameters()}
    e.backward(loss_of(e), last=True)
    norm = e.step_or_skip(max_grad_norm=1e-3)
    assert norm is not None and float(norm) > 1e-3  # the norm before clipping
    moved = [n for n, p in e.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved
    after = {n: p.detach().clone() for n, p in e.model.named_parameters()}
    e.backward(loss_of(e) * float("nan"), last=True)
    assert e.step_or_skip(max_grad_norm=1.0) is None
    assert all(torch.equal(p, after[n]) for n, p in e.model.named_parameters())
    assert all(p.grad is None for p in e.model.parameters())  # the bad gradients are dropped


def test_scale_lr_scales_the_base_rate_not_the_last_one():
    e = engine(lr=0.5)
    e.scale_lr(0.1)
    e.scale_lr(0.2)
    assert [g["lr"] for g in e.param_groups] == [pytest.approx(0.1)]


def test_an_offloaded_engine_refuses_to_compute_until_reloaded():
    e = engine()
    e.backward(loss_of(e), last=True)
    e.step_or_skip(1.0)
    state_before = {k: v.clone() for k, v in next(iter(e.optimizer.state.values())).items()}
    e.offload()
    e.offload()  # idempotent
    assert e.offloaded
    assert all(p.grad is None for p in e.model.parameters())  # gradients are dropped, not carried
    for call in (lambda: e.backward(loss_of(e), last=True), lambda: e.step_or_skip(1.0), e.full_tensors):
        with pytest.raises(EngineStateError, match="reload"):
            call()
    e.reload()
    assert not e.offloaded
    state_after = next(iter(e.optimizer.state.values()))
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())
    e.backward(loss_of(e), last=True)
    assert e.step_or_skip(1.0) is not None


def test_full_tensors_are_the_merged_model_with_hugging_face_names():
    e = engine(lora=True)
    with torch.no_grad():
        for name, p in e.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)  # the adapters now change the weights
    specs, tensors = e.full_tensors()
    full = dict(zip([name for name, _, _ in specs], tensors))
    plain = build_tiny_qwen2(0).state_dict()
    assert set(full) == {n for n, _ in build_tiny_qwen2(0).named_parameters()}
    q = "model.layers.0.self_attn.q_proj.weight"
    layer = e.model.get_submodule("model.layers.0.self_attn.q_proj")
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert torch.allclose(full[q], plain[q] + layer.scaling["default"] * (b @ a), atol=1e-6)
    assert e.trainable_parameters() == sum(p.numel() for p in e.model.parameters() if p.requires_grad)
    assert e.trainable_parameters() < e.total_parameters()


PROBES = re.compile(r"\bds_(id|numel|shape)\b|\bimport deepspeed\b|\bfrom deepspeed\b|\bfrom peft\b|\bimport peft\b|"
                    r"BaseTunerLayer|_disable_adapters|optim\.engine\b|\.engine ==")


def test_nothing_outside_the_engine_asks_which_engine_or_whether_adapters_exist():
    """DeepSpeed's and peft's own names appear only in engine/ and models/lora.py (the
    adapters' implementation, which the engine uses); the job's `trainer.engine` is read
    in engine/__init__.py and by the pre-start checks, which plan FSDP2 only."""
    allowed = {TRAINER / "models" / "lora.py", TRAINER / "preflight" / "checks.py"}
    found = [f"{path.relative_to(TRAINER)}:{n}: {line.strip()}"
             for path in TRAINER.rglob("*.py") if "engine" not in path.relative_to(TRAINER).parts[:1]
             and path not in allowed
             for n, line in enumerate(path.read_text().splitlines(), 1) if PROBES.search(line)]
    assert not found, found
