"""The memory plan against what a real GPU measured: `make gpu-check`'s report from an H200
(bench/results/gpu-check-h200-2026-11-26.json: our train step on Qwen2 0.5B and 1.5B shapes,
`max_memory_allocated`, `max_memory_reserved`, and the memory outside the allocator).

The plan is recomputed here from the same job and shapes the GPU run planned with, so a
change to the plan (its terms or its margins) is held to the measurements, not to itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT = json.loads((ROOT / "bench/results/gpu-check-h200-2026-11-26.json").read_text())
GIB = 1024 ** 3
sys.path.insert(0, str(ROOT / "bench"))


def _measured():
    rows = REPORT["parts"]["memory"]["tables"]["plan against the allocator's peak"]
    return [r for r in rows if "max reserved GiB" in r]


def _plan(shape: str, tokens: int, checkpointing: bool):
    from gpu_check_parts import QWEN2_SHAPES
    from gpu_check_train import _config

    from rlhf_trainer.preflight import memory_plan as mp

    gpu = int(REPORT["machine"]["gpu_memory"].split()[0]) * 1024 ** 2
    return mp, mp.plan(_config(tokens, checkpointing), QWEN2_SHAPES[shape], 1, gpu)


@pytest.mark.parametrize("row", _measured(), ids=lambda r: f"{r['shape']}-{r['tokens/micro-batch']}")
def test_the_plan_covers_the_reserved_peak_and_models_the_allocated_one(row):
    mp, plan = _plan(row["shape"], row["tokens/micro-batch"], row["checkpointing"])
    in_allocator = (plan.total - plan.fixed) / GIB
    assert in_allocator >= row["max reserved GiB"], (in_allocator, row)
    # the terms themselves (before the allocator's margin) model what was allocated, within 3 %
    modelled = in_allocator / (1 + mp.FRAGMENTATION)
    assert abs(modelled - row["max allocated GiB"]) <= 0.03 * row["max allocated GiB"], (modelled, row)
    # and the margin is not so wide that it wastes the GPU: at most 10 % over the reserved peak
    assert in_allocator <= 1.10 * row["max reserved GiB"], (in_allocator, row)


def test_the_memory_outside_the_allocator_is_planned():
    from rlhf_trainer.preflight.memory_runtime import CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES

    outside = max(r["outside allocator GiB (context + NCCL)"] for r in _measured())
    assert CUDA_CONTEXT_BYTES / GIB >= outside  # a world of one: the context alone, no communicator
    assert NCCL_COMMUNICATOR_BYTES / GIB >= REPORT["parts"]["nccl"]["communicator_gib_world1"]
