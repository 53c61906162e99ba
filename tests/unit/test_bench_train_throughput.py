"""bench/train_throughput.py runs (tiny shape, one step, CPU) and prints what it promises,
so the script cannot rot behind the trainer's changes; its model-FLOPs count and its
out-of-memory handling checked alone."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "train_throughput.py"


def bench():
    spec = importlib.util.spec_from_file_location("train_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_shape_runs_both_sides_on_cpu():
    args = ["--shape", "tiny", "--steps", "1", "--rows", "8", "--prompt", "8", "--max-response", "24", "--budget", "128"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout
    m = re.search(r"^shape tiny \(([\d,]+) parameters without the input embedding\), 8 sequences, (\d+) tokens per step "
                  r"\(real, counted on both sides\), (\S+) model FLOPs per step$", out, re.M)
    assert m, out
    assert math.isfinite(float(m[3])) and float(m[3]) > 6 * int(m[1].replace(",", "")) * int(m[2])
    for side in ("rlhf_trainer", "plain HF"):  # both unpadded: they computed the real tokens only
        s = re.search(rf"^{side} \(no checkpointing\): ([\d,]+) tokens/s, ([\d.]+) s/step, MFU n/a on CPU, "
                      rf"memory ([\d.]+) GiB \(process max RSS\), packed \((\d+) tokens computed\)$", out, re.M)
        assert s, out
        assert int(s[1].replace(",", "")) > 0 and float(s[3]) > 0 and s[4] == m[2]
    ratio = re.search(r"^ratio rlhf_trainer / plain HF tokens/s \(no checkpointing\): ([\d.]+)$", out, re.M)
    assert ratio and float(ratio[1]) > 0, out


def test_model_flops_leave_out_the_input_embedding_and_count_the_head():
    b = bench()
    with torch.device("meta"):
        model = b.build("tiny", torch.device("meta"))  # tied: the head is the embedding matrix
    v, h, f, layers = 512, 64, 128, 2
    # per layer: q (h x h + h), k and v (h x 32 + 32 each: 2 key/value heads of 16), o (h x h),
    # gate/up/down (3 x h x f), two norms; then the final norm and the head (v x h)
    per_layer = (h * h + h) + 2 * (h * 32 + 32) + h * h + 3 * h * f + 2 * h
    n = layers * per_layer + h + v * h
    flops, got_n = b.flops_per_step(model, [10, 30])
    assert got_n == n
    assert flops == 6 * n * 40 + 12 * layers * h * (10 * 10 + 30 * 30)


def test_out_of_memory_is_reported_not_raised():
    b = bench()

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def old_style_oom():
        raise RuntimeError("CUDA error: out of memory")

    assert b.measure(oom, torch.device("cpu"))[0] is None
    assert b.measure(old_style_oom, torch.device("cpu"))[0] is None
    assert b.measure(lambda: 0.5, torch.device("cpu"))[0] == 0.5
    with pytest.raises(RuntimeError, match="shape mismatch"):
        b.measure(lambda: (_ for _ in ()).throw(RuntimeError("shape mismatch")), torch.device("cpu"))
