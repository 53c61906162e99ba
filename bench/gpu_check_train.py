"""The training parts of `make gpu-check` (bench/gpu_check.py): DeepSpeed ZeRO-2/3 and LoRA
on CUDA, tokens/s and MFU like for like against plain Hugging Face training, the gpu-marked
tests' junit report, and the demo job on CUDA. (Two-rank parity: gpu_check_parity.py; the
memory plan against the allocator: gpu_check_memory.py.)"""

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

from gpu_check_parts import GIB, QWEN2_SHAPES, ROOT, gib, init_world

DEMO_TIMEOUT_S = 120


def _config(tokens: int, checkpointing: bool | None, sets: tuple[str, ...] = ()):
    from rlhf_contract.api import load_job
    from rlhf_contract.trainer_config import TrainerConfig

    sets = ["algorithm.klCoef=0", f"trainer.maxTokensPerMicroBatch={tokens}", *sets]
    if checkpointing is not None:
        sets.append(f"trainer.parallelism.activationCheckpointing={str(checkpointing).lower()}")
    return TrainerConfig.from_job(load_job(ROOT / "examples/local-grpo.yaml", sets))


# ---- 6. DeepSpeed ZeRO-2 and ZeRO-3, LoRA ------------------------------------------------

ENGINE_CASES = {
    "ZeRO-2": ("trainer.engine=deepspeed", "trainer.deepspeed.zeroStage=2"),
    "ZeRO-3": ("trainer.engine=deepspeed", "trainer.deepspeed.zeroStage=3"),
    "LoRA (FSDP2)": ("model.lora.rank=16",),
}
"""--set overrides of the demo job for each engine case (world 1, the 0.5B shape)."""
ENGINE_STEPS = 4


def deepspeed_import_error() -> str | None:
    """Why deepspeed cannot be imported on this machine (its torch), or None."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (an ImportError, or its op builders failing on this torch)
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def engine_verdict(losses: list[float], skipped: list[float]) -> str:
    """A case passes when every step completed with a finite loss and none was skipped."""
    import math

    if not losses:
        return "no step completed"
    if not all(math.isfinite(x) for x in losses):
        return f"non-finite loss {losses}"
    if any(skipped):
        return f"skipped steps {skipped}"
    return "holds"


def _engine_case(sets: tuple[str, ...], model_dir: str, device: torch.device, vocab: int) -> dict:
    """The trainer's own model loading and engine (rl/models.py build_models) for `sets`, then
    ENGINE_STEPS steps of TrainStep on the same rows: losses, skipped steps, peaks (CUDA)."""
    import train_throughput as tt

    from rlhf_trainer.distributed import DistInfo
    from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats
    from rlhf_trainer.rl.models import build_models
    from rlhf_trainer.rl.step import TrainStep

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = _config(4096, False, ("trainer.learningRate=0.00001", *sets)).model_copy(update={"model_path": model_dir})
    models, layout = build_models(config, DistInfo(0, 1, 0, device), 0)
    step = TrainStep(config.algorithm, models, layout, max_tokens_per_micro_batch=4096, max_grad_norm=1.0,
                     temperature=1.0, device=device)
    rows = tt.make_rows(16, vocab, 128 if cuda else 8, 256 if cuda else 16)
    batch = RolloutBatch(rows, 8, RolloutStats(*[0.0] * 5, 0.0, 0, 0, 0.0, 0.0, 0.0, num_tokens=0))
    losses, skipped, start = [], [], time.perf_counter()
    for _ in range(ENGINE_STEPS):
        metrics = step(batch, step.prepare(batch))
        losses.append(float(metrics["loss"]))
        skipped.append(float(metrics.get("skipped_steps", 0)))
    if cuda:
        torch.cuda.synchronize()
    out = {"losses": [round(x, 6) for x in losses], "skipped": skipped, "verdict": engine_verdict(losses, skipped),
           "s/step": round((time.perf_counter() - start) / ENGINE_STEPS, 3),
           "max allocated GiB": gib(torch.cuda.max_memory_allocated()) if cuda else None,
           "max reserved GiB": gib(torch.cuda.max_memory_reserved()) if cuda else None,
           "trainable parameters": sum(p.numel() for p in models.engine.model.parameters() if p.requires_grad)}
    del models, layout, step
    return out


def run_engines(model_dir: str, device: torch.device, vocab: int) -> list[dict]:
    """One row per ENGINE_CASES entry, for the model saved in `model_dir`; the DeepSpeed
    rows say so when deepspeed cannot be imported here. Needs a process group of one."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # DeepSpeed reads them
        os.environ.setdefault(key, value)
    ds_error = deepspeed_import_error()
    rows = []
    for name, sets in ENGINE_CASES.items():
        if ds_error and "trainer.engine=deepspeed" in sets:
            rows.append({"engine": name, "verdict": f"skipped: deepspeed cannot import here ({ds_error})"})
            continue
        try:
            rows.append({"engine": name, **_engine_case(sets, model_dir, device, vocab)})
        except Exception as exc:  # noqa: BLE001  (one engine's failure is its row, not the part's end)
            rows.append({"engine": name, "verdict": f"failed: {type(exc).__name__}: {str(exc)[:300]}"})
    return rows


def part_engines() -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    init_world()
    with tempfile.TemporaryDirectory(prefix="gpu-check-engines-") as model_dir:
        torch.manual_seed(0)
        fields = {k: v for k, v in QWEN2_SHAPES["0.5b"].items() if k != "model_type"}
        Qwen2ForCausalLM(Qwen2Config(**fields)).to(torch.bfloat16).save_pretrained(model_dir)
        rows = run_engines(model_dir, torch.device("cuda"), fields["vocab_size"])
    ran = [r for r in rows if not r["verdict"].startswith("skipped")]
    ok = bool(ran) and all(r["verdict"] == "holds" for r in ran)
    return {"status": "ok" if ok else "failed", "tables": {"engines, world 1, Qwen2 0.5B shape": rows},
            "deepspeed": deepspeed_import_error() or "imports",
            "summary": "; ".join(f"{r['engine']}: {r['verdict']}" + (f", peak {r['max reserved GiB']} GiB reserved"
                                                                     if r.get("max reserved GiB") else "")
                                 for r in rows)}


# ---- 7. throughput like for like, and the gpu-marked tests --------------------------------

def part_throughput() -> dict:
    import train_throughput as tt

    from rlhf_trainer.metrics import peak_flops

    init_world()
    device = torch.device("cuda")
    rows = tt.make_rows(64, tt.SHAPES["1.5b"]["vocab_size"], 256, 1024)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
    with torch.device("meta"):
        flops, _ = tt.flops_per_step(tt.build("1.5b", torch.device("meta")), lengths)
    peak = peak_flops(torch.cuda.get_device_name(0))
    results = tt.run_pairs("1.5b", rows, 16384, device, 2, [False, True])
    table = [{"side": r["label"], "layout": r["layout"], "tokens computed": r["computed_tokens"],
              "tokens/s": "OOM" if r["seconds"] is None else f"{sum(lengths) / r['seconds']:,.0f}",
              "s/step": None if r["seconds"] is None else round(r["seconds"], 3),
              "MFU": None if r["seconds"] is None or not peak else f"{flops / r['seconds'] / peak:.1%}",
              "peak GiB": round(r["peak_gib"], 2)} for r in results]
    ratios = tt.ratios(results)
    return {"status": "ok", "tables": {"1.5B shape, 64 sequences, 16384-token micro-batches": table},
            "tokens_per_step": sum(lengths), "ratios": {("checkpointing" if k else "no checkpointing"): v
                                                        for k, v in ratios.items()},
            "summary": f"{sum(lengths)} real tokens/step, counted on both sides: "
                       + "; ".join(f"{r['side']} {r['tokens/s']} tokens/s MFU {r['MFU']} ({r['layout']})"
                                   for r in table)
                       + "; ours / plain HF " + ", ".join(f"{'checkpointing' if k else 'no checkpointing'} "
                                                          + (f"{v:.2f}" if v else "n/a") for k, v in ratios.items())}


GPU_TESTS_DESELECT = "not learns_the_demo_task"
"""The gpu-marked tests left out of the part: the demo's 250-step learning runs (up to 30
minutes each); the demo part runs that job, cut to its box."""


def junit_summary(path: str) -> dict:
    """Counts and the failing tests of a pytest junit XML file."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "failed": failed}


def sigint_default() -> None:
    """In a child, before exec: SIGINT at its default. A command started in the background by a
    shell (as a device call or CI may start us) inherits SIGINT ignored, and then the Ctrl-C
    that should end a cut run (pytest writing its report, local mode stopping its processes)
    does nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cut(command: list[str], cwd: str | None, timeout_s: float,
            grace_s: float = 15) -> tuple[str, int | None, bool]:
    """Run `command`; past `timeout_s`, Ctrl-C (pytest then ends its session and writes its
    reports; local mode stops its servers and trainer), and `grace_s` later a kill of its
    process group. (output, exit code, whether it was cut)."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=sigint_default)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
        return log, proc.returncode, False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            log, _ = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        return log or "", proc.returncode, True


def part_gpu_tests() -> dict:
    """`pytest -m gpu tests` with --junitxml into $OUT (else runs/gpu-check/), interrupted
    (SIGINT: pytest still writes its report) before the part's box ends. A module that cannot
    be collected on that machine (a package it lacks) is an error in the report, and the
    gpu-marked tests of the other modules still run."""
    out_dir = os.environ.get("OUT") or str(ROOT / "runs" / "gpu-check")
    os.makedirs(out_dir, exist_ok=True)
    junit = os.path.join(out_dir, "gpu-tests.junit.xml")
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + 120))
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-k", GPU_TESTS_DESELECT, "tests", "-q",
               "-p", "no:cacheprovider", "--continue-on-collection-errors", f"--junitxml={junit}"]
    log, code, cut = run_cut(command, str(ROOT), max(10.0, deadline - time.time() - 20))
    summary = junit_summary(junit) if os.path.exists(junit) else None
    ok = summary is not None and not summary["failures"] and not summary["errors"] and not cut
    return {"status": "ok" if ok else "failed", "junit": junit, "exit_code": code, "cut": cut,
            "counts": summary, "log_tail": (log or "")[-2000:],
            "summary": (f"{summary['tests']} tests: {summary['failures']} failed, {summary['errors']} errors, "
                        f"{summary['skipped']} skipped"
                        + (f" ({', '.join(summary['failed'][:5])})" if summary['failed'] else "")
                        if summary else "no junit report") + (" (cut at the time box)" if cut else "")
                       + f"; -k '{GPU_TESTS_DESELECT}'"}


def part_demo() -> dict:
    """examples/local-grpo.yaml through `rlhfctl run` (CPU rollout servers, the trainer on
    CUDA), cut at DEMO_TIMEOUT_S: the steps it took and the reward's rise."""
    out = tempfile.mkdtemp(prefix="gpu-check-demo-")
    command = [sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples/local-grpo.yaml"),
               "--output", out, "--overwrite"]
    box_end = float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + DEMO_TIMEOUT_S + 20))
    timeout = max(10.0, min(DEMO_TIMEOUT_S, box_end - time.time() - 30))
    log, code, cut = run_cut(command, None, timeout, grace_s=20)
    finished = not cut
    path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path).read().splitlines()] if os.path.exists(path) else []
    first = sum(r["reward_mean"] for r in rows[:10]) / max(len(rows[:10]), 1)
    last = sum(r["reward_mean"] for r in rows[-10:]) / max(len(rows[-10:]), 1)
    gpu = max((r.get("peak_gpu_memory_bytes") or 0 for r in rows), default=0)
    table = [{"steps": len(rows), "finished": finished, "exit code": code,
              "reward first 10": round(first, 3), "reward last 10": round(last, 3),
              "step seconds (mean)": round(sum(r["step_seconds"] for r in rows) / max(len(rows), 1), 3),
              "peak GPU GiB": round(gpu / GIB, 3)}]
    ok = bool(rows) and gpu > 0 and (code == 0 or not finished)
    return {"status": "ok" if ok else "failed", "tables": {"demo job": table}, "log_tail": (log or "")[-2000:],
            "summary": f"{len(rows)} steps ({'done' if finished else f'cut at {timeout:.0f} s'}), "
                       f"reward {first:.2f} -> {last:.2f}, "
                       f"trainer on CUDA: {gpu > 0}"}

