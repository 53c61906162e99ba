"""The colocated memory plan (rlhf_trainer/preflight/memory_colocated.py): the three phases
of a GPU shared by the trainer and a rollout server's worker, each from its own parts
(recomputed here from the model's parameter count, not from the module's formula), and
preflight and `rlhfctl plan` refusing a colocated job whose generate phase cannot fit,
naming the field to change."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf_trainer.preflight import memory_plan as mp
from rlhf_trainer.preflight.memory_colocated import SERVER_WORKING_BYTES, colocated_phases
from rlhf_trainer.preflight.memory_runtime import CUDA_CONTEXT_BYTES

from test_memory_plan import QWEN_7B, ROOT, grpo_config, write_model

COLOCATED = ["rollout.placement=colocated", "rollout.maxStaleness=0", "rollout.engine=vllm"]


def phases_of(*sets, world=8):
    config = grpo_config(*COLOCATED, *sets)
    trainer = mp.plan(config, QWEN_7B, world, mp.gib(80))
    return config, trainer, {p.name: p.bytes for p in colocated_phases(config, QWEN_7B, trainer)}


def params_7b() -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import torch

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in QWEN_7B.items() if k != "architectures"}))
    return sum(p.numel() for p in model.parameters())


def test_the_phases_are_the_sum_of_their_parts():
    kv = 20 * 2**30
    config, trainer, phases = phases_of(f"rollout.vllm.kvCacheMemoryBytes={kv}", "rollout.tensorParallelSize=2",
                                        "rollout.colocated.offloadTrainer=true")
    server_weights = 2 * params_7b() / 2  # bf16, over tensorParallelSize 2
    # asleep, a server keeps only its CUDA context: the trainer's plan plus that
    assert phases["train"] == trainer.total + CUDA_CONTEXT_BYTES
    # generating with the trainer offloaded: the trainer's context (and NCCL) alone beside the server
    expected = trainer.fixed + server_weights + kv + CUDA_CONTEXT_BYTES + SERVER_WORKING_BYTES
    assert abs(phases["generate"] - expected) < 2**20
    # the trainer resident instead: its persistent state (with the allocator's margin) comes back
    _, resident_trainer, resident = phases_of(f"rollout.vllm.kvCacheMemoryBytes={kv}", "rollout.tensorParallelSize=2",
                                              "rollout.colocated.offloadTrainer=false")
    persistent = sum(t.bytes for t in resident_trainer.terms if t.phase == "persistent")
    assert abs(resident["generate"] - phases["generate"] - (1 + mp.FRAGMENTATION) * persistent) < 2**20
    # sync: weights awake, no KV cache, more than the trainer's persistent state alone
    assert trainer.fixed + server_weights + persistent < phases["sync"] < phases["generate"] + persistent * 2
    assert phases["sync"] < resident["generate"]


def test_a_kv_cache_too_large_is_refused_naming_the_field(tmp_path):
    from rlhf_trainer.preflight import memory_problems

    model = write_model(tmp_path, QWEN_7B)
    fits = grpo_config(*COLOCATED, f"model.path={model}", "trainer.gpuMemoryGiB=80",
                       f"rollout.vllm.kvCacheMemoryBytes={16 * 2**30}")
    assert memory_problems(fits, 8, QWEN_7B) == []
    big = grpo_config(*COLOCATED, f"model.path={model}", "trainer.gpuMemoryGiB=80",
                      f"rollout.vllm.kvCacheMemoryBytes={70 * 2**30}")
    [problem] = memory_problems(big, 8, QWEN_7B)
    assert problem.startswith("spec.rollout.placement: colocated, the generate phase needs")
    assert "rollout.vllm.kvCacheMemoryBytes" in problem


def test_rlhfctl_plan_shows_the_phases_and_exits_2_when_one_does_not_fit(tmp_path):
    model = write_model(tmp_path, QWEN_7B)
    base = [sys.executable, "-m", "rlhf_launcher.cli", "plan", str(ROOT / "examples/local-grpo.yaml"),
            "--gpu-memory-gib", "80", "--gpus", "8", "--set", f"model.path={model}",
            *[a for s in COLOCATED for a in ("--set", s)]]
    bad = subprocess.run([*base, "--set", f"rollout.vllm.kvCacheMemoryBytes={70 * 2**30}"], capture_output=True,
                         text=True, timeout=300)
    assert all(phase in bad.stdout for phase in ("train", "sync", "generate")), bad.stdout
    assert bad.returncode == 2 and "rollout.vllm.kvCacheMemoryBytes" in bad.stderr


@pytest.mark.parametrize("placement", ["separate"])
def test_a_separate_job_has_no_phases(placement):
    config = grpo_config(f"rollout.placement={placement}")
    assert colocated_phases(config, QWEN_7B, mp.plan(config, QWEN_7B, 8, mp.gib(80))) == []


def test_fp8_rollouts_hold_the_layers_at_one_byte_and_the_rest_at_two():
    """rollout.vllm.quantization: the layers' weights at 1 byte, the embeddings and the untied
    LM head (Qwen2-7B's) at 2, plus one layer in bf16 while vLLM (re)loads it; counted here from
    the model's own modules, not from the plan's shape."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import torch

    kv = 20 * 2**30
    sets = (f"rollout.vllm.kvCacheMemoryBytes={kv}", "rollout.tensorParallelSize=2")
    _, _, bf16 = phases_of(*sets)
    config, _, fp8 = phases_of(*sets, "rollout.vllm.quantization=fp8")
    assert config.sampling.quantization == "fp8"
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in QWEN_7B.items() if k != "architectures"}))
    in_layers = sum(p.numel() for p in model.model.layers.parameters())
    one_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    rest = params_7b() - in_layers
    bf16_weights, fp8_weights = 2 * params_7b() / 2, (in_layers + 2 * rest + 2 * one_layer) / 2
    for phase in ("sync", "generate"):
        assert abs((bf16[phase] - fp8[phase]) - (bf16_weights - fp8_weights)) < 2**20, phase
    assert fp8["train"] == bf16["train"]  # asleep: no weights on the GPU either way
    # about 40 % of a 7B model's bf16 weights saved (its 1.1 B embedding and head parameters stay)
    assert 0.35 < (bf16_weights - fp8_weights) / bf16_weights < 0.45


def test_the_cpu_engine_plans_no_quantization():
    config = grpo_config("rollout.engine=cpu", "rollout.vllm.quantization=fp8")
    assert config.sampling.quantization is None
