"""The trainer's CUDA paths (marker `gpu`, skipped without CUDA): one GPU learning the demo
task through the real local mode (fully and with LoRA adapters), and the train step under FSDP and context parallelism on
NCCL (bf16 compute, fp32 master weights) against one fp32 CPU process, when two GPUs are
present."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_launcher.local import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "workers" / "train_step_parity.py"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_one_gpu_learns_the_demo_task(tmp_path):
    out = tmp_path / "demo"
    res = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples" / "local-grpo.yaml"),
                          "--output", str(out)], capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last > 0.9 and last > 5 * first, (first, last)
    assert all(r["skipped_steps"] == 0 for r in rows)
    assert rows[-1]["peak_gpu_memory_bytes"] > 0


def test_adamw_is_fused_on_cuda():
    from rlhf_contract.trainer_config import OptimConfig
    from rlhf_trainer.optim import adamw

    group = adamw(torch.nn.Linear(4, 4).cuda(), OptimConfig()).param_groups[0]  # the demo above steps it on FSDP2 DTensors
    assert group["fused"] and not group["foreach"]


def test_one_gpu_learns_the_demo_task_with_lora(tmp_path):
    """Adapters under FSDP2's bf16 mixed precision (frozen fp32 base, fp32 adapters)."""
    out = tmp_path / "lora"
    overrides = ["model.lora.rank=16", "trainer.learningRate=0.003", "rollout.temperature=0.25", "rollout.maxTokens=1",
                 "algorithm.klCoef=0", "schedule.totalSteps=120", "schedule.saveEvery=60"]
    res = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples" / "local-grpo.yaml"),
                          "--output", str(out), *[a for o in overrides for a in ("--set", o)]],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last >= 0.6 and last >= 3 * first, (first, last)
    assert all(r["skipped_steps"] == 0 for r in rows) and rows[-1]["trainable_parameters"] < 20000
    assert (out / "final" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL refuses two ranks on one GPU)")
@pytest.mark.parametrize("case", ["2,1,1:grpo", "2,1,1:token-mean-2mb", "1,1,2:dapo-dual:0.7"])
def test_two_gpu_step_matches_one_process(tmp_path, case):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(WORKER), "--device", "cuda", "--out", str(out), case]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    r = json.loads(out.read_text())[case]
    for key in ("loss", "entropy", "grad_norm", "advantage_mean"):
        assert r["metrics"][key] == pytest.approx(r["ref_metrics"][key], rel=3e-2, abs=1e-3), key  # bf16 compute
    assert r["param_rel_err"] < 3e-2, r["worst"]


def test_offload_frees_the_gpu_and_reload_trains_on_as_before():
    """Colocation's offload (engine/): a trained model's parameters and AdamW state leave
    the GPU (allocated memory drops by at least their bytes), and after reload the next
    steps match, bit for bit, those of a twin that never moved."""
    from rlhf_contract.trainer_config import OptimConfig
    from rlhf_trainer.engine import Fsdp2Engine
    from rlhf_trainer.models.builtin import build_tiny_qwen2

    def twin() -> Fsdp2Engine:
        model = build_tiny_qwen2(0).cuda()
        return Fsdp2Engine.train(model, OptimConfig(learning_rate=1e-3))

    ids = torch.randint(0, 14, (4, 12), device="cuda")

    def step(e: Fsdp2Engine) -> float:
        e.zero_grad()
        loss = e.model(input_ids=ids, labels=ids).loss
        e.backward(loss, last=True)
        e.step_or_skip(1.0)
        return float(loss)

    moved, still = twin(), twin()
    assert step(moved) == step(still)
    states = sum(v.numel() * v.element_size() for s in moved.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.is_cuda)
    params = sum(p.numel() * p.element_size() for p in moved.model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved.offload()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= params + states, (freed, params, states)
    moved.reload()
    assert [step(moved) for _ in range(3)] == [step(still) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(moved.model.parameters(), still.model.parameters()))
