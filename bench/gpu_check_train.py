"""The training parts of `make gpu-check` (bench/gpu_check.py): the memory plan against the
allocator, tokens/s and MFU against plain Hugging Face training, and the demo job on CUDA."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from gpu_check_parts import GIB, MEMORY_CASES, QWEN2_SHAPES, ROOT, device_used, gib, init_world

DEMO_TIMEOUT_S = 120


def _config(tokens: int, checkpointing: bool | None):
    from rlhf_contract.api import load_job
    from rlhf_contract.trainer_config import TrainerConfig

    sets = ["algorithm.klCoef=0", f"trainer.maxTokensPerMicroBatch={tokens}"]
    if checkpointing is not None:
        sets.append(f"trainer.parallelism.activationCheckpointing={str(checkpointing).lower()}")
    return TrainerConfig.from_job(load_job(ROOT / "examples/local-grpo.yaml", sets))


def _train_steps(shape: dict, tokens: int, checkpointing: bool, steps: int = 2) -> dict:
    """Our TrainStep (FSDP2 over a mesh of one, bf16 compute, fused AdamW) on a randomly
    initialised Qwen2 of `shape`, two micro-batches of up to `tokens`: peaks and timing."""
    import train_throughput as tt
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_contract.api.models import AlgorithmSpec
    from rlhf_contract.api.presets import PRESETS
    from rlhf_contract.trainer_config import OptimConfig
    from rlhf_trainer.engine import Fsdp2Engine
    from rlhf_trainer.models.logprob_head import attach_logprob_head
    from rlhf_trainer.optim import adamw
    from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats
    from rlhf_trainer.parallel.parallelize import parallelize_models
    from rlhf_trainer.rl.models import Models
    from rlhf_trainer.rl.step import TrainStep

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(Qwen2Config(**fields))
    layout = parallelize_models(model, ref=None, critic=None, world_size=1, tp=1, cp=1,
                                activation_checkpointing=checkpointing, device_type="cuda")
    attach_logprob_head(model)
    step = TrainStep(AlgorithmSpec(**{**PRESETS["grpo"], "kl_coef": 0.0}),
                     Models(Fsdp2Engine(model, adamw(model, OptimConfig(learning_rate=1e-6)))), layout,
                     max_tokens_per_micro_batch=tokens, max_grad_norm=1.0, temperature=1.0,
                     device=torch.device("cuda"))
    rows = tt.make_rows(8 * -(-2 * tokens // (832 * 8)), shape["vocab_size"], 256, 1024)  # ~2 micro-batches
    stats = RolloutStats(*[0.0] * 5, 0.0, 0, 0, 0.0, 0.0, 0.0,
                         num_tokens=sum(len(r.prompt_ids) + len(r.response_ids) for r in rows))
    batch = RolloutBatch(rows, 8, stats)
    seconds = []
    for _ in range(steps):
        tensors = step.prepare(batch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(batch, tensors)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    out = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
           "outside_allocator": device_used() - torch.cuda.memory_reserved(), "tokens": stats.num_tokens,
           "seconds": seconds[-1]}
    del step, model, layout, tensors, batch
    gc.collect()
    torch.cuda.empty_cache()
    return out


def part_memory() -> dict:
    from rlhf_trainer.preflight import memory_plan as mp

    init_world()
    total = torch.cuda.get_device_properties(0).total_memory
    rows, worst = [], 0.0
    for name, tokens in MEMORY_CASES:
        decided = mp.plan(_config(tokens, None), QWEN2_SHAPES[name], 1, total)
        plan = mp.plan(_config(tokens, decided.activation_checkpointing), QWEN2_SHAPES[name], 1, total)
        row = {"shape": name, "tokens/micro-batch": tokens, "checkpointing": plan.activation_checkpointing,
               "plan total GiB": gib(plan.total), "plan in allocator GiB": gib(plan.total - plan.fixed),
               "plan fixed GiB": gib(plan.fixed)}
        try:
            m = _train_steps(QWEN2_SHAPES[name], tokens, plan.activation_checkpointing)
        except torch.cuda.OutOfMemoryError as exc:
            m = {"oom": str(exc)[:120]}
        if "oom" in m:  # the plan said it fits (the frames that held the memory are gone now)
            gc.collect()
            torch.cuda.empty_cache()
            rows.append({**row, "measured": f"OOM: {m['oom']}"})
            continue
        error = (plan.total - plan.fixed - m["reserved"]) / m["reserved"]
        worst = max(worst, abs(error))
        rows.append({**row, "max allocated GiB": gib(m["allocated"]), "max reserved GiB": gib(m["reserved"]),
                     "plan - reserved": f"{error:+.1%}", "outside allocator GiB (context + NCCL)":
                     gib(m["outside_allocator"]), "holds": m["reserved"] <= plan.total - plan.fixed})
    held = all(r.get("holds", False) for r in rows)
    return {"status": "ok" if held else "failed", "tables": {"plan against the allocator's peak": rows},
            "summary": f"{len(rows)} cases; the plan {'holds every' if held else 'MISSES a'} measured peak "
                       f"(reserved); largest error {worst:.0%}"}


def part_throughput() -> dict:
    import train_throughput as tt

    from rlhf_trainer.metrics import peak_flops

    init_world()
    device = torch.device("cuda")
    rows = tt.make_rows(64, tt.SHAPES["1.5b"]["vocab_size"], 256, 1024)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
    with torch.device("meta"):
        flops, _ = tt.flops_per_step(tt.build("1.5b", torch.device("meta")), lengths)
    micro_rows = max(1, int(16384 // (sum(lengths) / len(rows)) // 2))
    peak = peak_flops(torch.cuda.get_device_name(0))
    table, seconds = [], {}
    for name, side in (("rlhf_trainer", lambda: tt.ours("1.5b", rows, 16384, device, 3)),
                       ("plain HF", lambda: tt.peer("1.5b", rows, micro_rows, device, 3))):
        t, memory = tt.measure(side, device)
        seconds[name] = t
        table.append({"side": name, "tokens/s": "OOM" if t is None else f"{sum(lengths) / t:,.0f}",
                      "s/step": None if t is None else round(t, 3),
                      "MFU": None if t is None or not peak else f"{flops / t / peak:.1%}", "peak GiB": round(memory, 2)})
    ratio = (seconds["plain HF"] / seconds["rlhf_trainer"]) if all(seconds.values()) else None
    return {"status": "ok", "tables": {"1.5B shape, 64 sequences": table}, "tokens_per_step": sum(lengths),
            "summary": f"{sum(lengths)} tokens/step: " + "; ".join(f"{r['side']} {r['tokens/s']} tokens/s MFU {r['MFU']}"
                                                                     for r in table)
                       + (f"; ours / plain HF {ratio:.2f}" if ratio else "")}


def part_demo() -> dict:
    """examples/local-grpo.yaml through `rlhfctl run` (CPU rollout servers, the trainer on
    CUDA), cut at DEMO_TIMEOUT_S: the steps it took and the reward's rise."""
    out = tempfile.mkdtemp(prefix="gpu-check-demo-")
    command = [sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples/local-grpo.yaml"),
               "--output", out, "--overwrite"]
    box_end = float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + DEMO_TIMEOUT_S + 20))
    timeout = max(10.0, min(DEMO_TIMEOUT_S, box_end - time.time() - 30))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        finished = True
    except subprocess.TimeoutExpired:  # Ctrl-C: local mode stops its servers and trainer (their own sessions)
        proc.send_signal(signal.SIGINT)
        try:
            log, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        finished = False
    path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path).read().splitlines()] if os.path.exists(path) else []
    first = sum(r["reward_mean"] for r in rows[:10]) / max(len(rows[:10]), 1)
    last = sum(r["reward_mean"] for r in rows[-10:]) / max(len(rows[-10:]), 1)
    gpu = max((r.get("peak_gpu_memory_bytes") or 0 for r in rows), default=0)
    table = [{"steps": len(rows), "finished": finished, "exit code": proc.returncode,
              "reward first 10": round(first, 3), "reward last 10": round(last, 3),
              "step seconds (mean)": round(sum(r["step_seconds"] for r in rows) / max(len(rows), 1), 3),
              "peak GPU GiB": round(gpu / GIB, 3)}]
    ok = bool(rows) and gpu > 0 and (proc.returncode == 0 or not finished)
    return {"status": "ok" if ok else "failed", "tables": {"demo job": table}, "log_tail": (log or "")[-2000:],
            "summary": f"{len(rows)} steps ({'done' if finished else f'cut at {timeout:.0f} s'}), "
                       f"reward {first:.2f} -> {last:.2f}, "
                       f"trainer on CUDA: {gpu > 0}"}
