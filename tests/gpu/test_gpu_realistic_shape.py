"""A realistic shape on one GPU (marker `gpu`, skipped without CUDA): a randomly
initialised Qwen2 of the 0.5B shape trained by the trainer's own `TrainStep` at 8192 tokens
per micro-batch (FSDP2 over a mesh of one, bf16 compute, activation checkpointing, packed
varlen attention, the chunked head): the allocator's peak within the memory plan's figure,
the step's metrics matching the same step in fp32 on the CPU within bf16 tolerance, and
the MFU printed (bench/train_throughput.py's FLOPs formula)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QWEN_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
                rms_norm_eps=1e-6)
BUDGET = 8192


def rows():
    from rlhf_trainer.data.sequences import Row

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(16):  # ~14k tokens: two micro-batches of up to 8192
        prompt = torch.randint(0, 151936, (int(torch.randint(128, 512, (1,), generator=gen)),), generator=gen)
        response = torch.randint(0, 151936, (int(torch.randint(64, 1024, (1,), generator=gen)),), generator=gen)
        out.append(Row(prompt.tolist(), response.tolist(), (-torch.rand(len(response), generator=gen)).tolist(),
                       float(torch.rand((), generator=gen) > 0.5), 0.0, False))
    return out


def run_step(device: torch.device, steps: int) -> tuple[dict, float, int]:
    """(first step's metrics, seconds per later step, peak allocated bytes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_contract.api.models import AlgorithmSpec
    from rlhf_contract.api.presets import PRESETS
    from rlhf_contract.trainer_config import OptimConfig
    from rlhf_trainer.models.logprob_head import attach_logprob_head
    from rlhf_trainer.optim import adamw
    from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats
    from rlhf_trainer.parallel.parallelize import parallelize_models
    from rlhf_trainer.engine import Fsdp2Engine
    from rlhf_trainer.rl.models import Models
    from rlhf_trainer.rl.step import TrainStep

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN_05B), dtype=torch.float32)
    a = AlgorithmSpec(**{**PRESETS["grpo"], "kl_coef": 0.0, "num_mini_batches": 1})
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    layout = parallelize_models(model, ref=None, critic=None, world_size=1, tp=1, cp=1,
                                activation_checkpointing=cuda, device_type=device.type)
    attach_logprob_head(model)
    optimizer = adamw(model, OptimConfig(learning_rate=1e-5))
    if cuda:
        assert optimizer.param_groups[0]["fused"]
    step = TrainStep(a, Models(Fsdp2Engine(model, optimizer)), layout, max_tokens_per_micro_batch=BUDGET, max_grad_norm=1.0,
                     temperature=1.0, device=device)
    data = rows()
    batch = RolloutBatch(data, 4, RolloutStats(*[0] * 11, num_tokens=sum(len(r.prompt_ids) + len(r.response_ids)
                                                                         for r in data)))
    first = step(batch, step.prepare(batch))
    elapsed = 0.0
    for _ in range(steps):
        tensors = step.prepare(batch)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(batch, tensors)
        if cuda:
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return first, elapsed / max(steps, 1), peak


def test_half_billion_at_8k_tokens_fits_its_plan_and_matches_fp32(tmp_path):
    import torch.distributed as dist

    from rlhf_contract.api import load_job
    from rlhf_contract.trainer_config import TrainerConfig
    from rlhf_launcher.local import free_port
    from rlhf_trainer.preflight import memory_plan as mp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        metrics, seconds, peak = run_step(torch.device("cuda", 0), steps=2)
    finally:
        dist.destroy_process_group()
    root = Path(__file__).resolve().parents[2]
    config = TrainerConfig.from_job(load_job(root / "examples/local-grpo.yaml", [
        "algorithm.klCoef=0", f"trainer.maxTokensPerMicroBatch={BUDGET}",
        "trainer.parallelism.activationCheckpointing=true"]))
    plan = mp.plan(config, QWEN_05B, 1, torch.cuda.get_device_properties(0).total_memory)
    planned = sum(t.bytes for t in plan.terms if t.phase in ("persistent", "micro-batch"))
    print(f"0.5B at {BUDGET} tokens: peak allocated {peak / 2**30:.2f} GiB, plan (micro-batch phase, "
          f"no context or margin) {planned / 2**30:.2f} GiB, plan total {plan.total / 2**30:.2f} GiB")
    assert peak <= plan.total - plan.fixed  # the plan holds what the allocator used
    assert peak >= 0.6 * planned  # and is not so loose that it says nothing

    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN_05B))
    n = sum(p.numel() for p in shape.parameters())  # tied: the embedding counted once, as the output head
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows()]
    attention = 12 * QWEN_05B["num_hidden_layers"] * QWEN_05B["hidden_size"] * sum(x * x for x in lengths)
    flops = 6 * n * sum(lengths) + attention
    peak_flops = 989e12 if "H100" in torch.cuda.get_device_name(0) or "H200" in torch.cuda.get_device_name(0) else None
    print(f"{sum(lengths) / seconds:,.0f} tokens/s, {seconds:.3f} s/step"
          + (f", MFU {flops / seconds / peak_flops:.1%}" if peak_flops else ""))

    # the same step in fp32 on the CPU (one process, no FSDP)
    cpu_metrics, _, _ = run_step(torch.device("cpu"), steps=0)
    for key in ("loss", "entropy", "grad_norm", "clip_fraction"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
        assert metrics[key] == pytest.approx(cpu_metrics[key], rel=3e-2, abs=2e-3), key
