"""`make gpu-check`'s part `parity`: the CPU parity tests' own worker
(tests/distributed/workers/train_step_parity.py) with two ranks on CUDA, FSDP2 2x1x1 GRPO and
context parallel 1x1x2, against one process, judged by those tests' own rule (the worker's
`mismatches`: METRIC_TOLERANCE, PARAM_REL_ERR).

One GPU: both ranks on device 0, each process with its own NCCL_HOSTID (NCCL refuses two
ranks on one GPU only when their host hashes match; it then talks over sockets on loopback,
a setup NCCL calls unsupported: the part is time-boxed, and a refusal is reported as such).

Judged in fp32: the trainer's bf16 mixed precision on CUDA is turned off in these ranks
(`--precision fp32`), so that the CPU tolerances mean what they mean on CPU. The same cases
in bf16 (the trainer as it runs) are reported beside them, figures only.

`spawn_ranks` starts the ranks without torchrun (LOCAL_RANK 0 for all, so all share one
GPU); the memory part's two-rank case uses it too. On CPU (gloo) the unit tests run the
same code (tests/unit/test_gpu_check_train.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORKER = ROOT / "tests" / "distributed" / "workers" / "train_step_parity.py"
PARITY_CASES = ["2,1,1:grpo", "1,1,2:grpo"]
"""FSDP2 over two ranks and context parallelism over two, the GRPO preset (KL in the loss)."""
PRECISIONS = ("fp32", "bf16")
"""Judged first (the CPU tolerances apply), then the trainer's bf16 mixed precision (figures)."""


def worker_module():
    """The CPU parity tests' worker, imported from its file (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("train_step_parity_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, base: dict | None = None) -> dict[str, str]:
    """One rank's environment: env:// rendezvous on loopback, every rank on GPU 0, and a host
    id of its own so that NCCL does not take two ranks of one GPU for a duplicate."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_HOSTID=f"gpu-check-rank-{rank}",
               NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def spawn_ranks(argv: list[str], world: int, timeout_s: float) -> list[dict]:
    """Run `python argv` as `world` ranks; each one's exit code and output tail. A rank that
    outlives `timeout_s` is killed (with the others) and reported with exit code None."""
    port = _free_port()
    # in the part's process group: the driver's kill at the end of the part's box ends them too
    procs = [subprocess.Popen([sys.executable, *argv], env=rank_env(r, world, port), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    out = []
    for proc in procs:
        try:
            log, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append({"exit_code": proc.returncode, "log_tail": log[-3000:]})
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            log, _ = proc.communicate()
            out.append({"exit_code": None, "log_tail": (log or "")[-3000:]})
    return out


def judge(results: dict, cases: list[str]) -> list[dict]:
    """One row per case: the CPU tests' rule (the worker's `mismatches`) applied to it."""
    w = worker_module()
    rows = []
    for case in cases:
        r = results.get(case)
        if r is None:
            rows.append({"case": case, "holds": False, "mismatches": "no result"})
            continue
        worst = max((abs(r["metrics"][k] - r["ref_metrics"][k]) / max(abs(r["ref_metrics"][k]), 1e-30)
                     for k in w.METRIC_KEYS if r["ref_metrics"].get(k) not in (None, 0)
                     and r["metrics"].get(k) is not None), default=0.0)
        bad = w.mismatches(r)
        rows.append({"case": case, "holds": not bad, "grad_norm": r["metrics"]["grad_norm"], "grad_norm (one process)":
                     r["ref_metrics"]["grad_norm"], "worst metric rel err": f"{worst:.1e}",
                     "weights rel err": f"{r['param_rel_err']:.1e}", "mismatches": "; ".join(bad)})
    return rows


def run_parity(device: str, cases: list[str], precision: str, timeout_s: float) -> tuple[dict, list[dict]]:
    """The worker's cases on two ranks (this file as each rank's entry point); its results."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-parity-") as tmp:
        out = Path(tmp) / "result.json"
        ranks = spawn_ranks([str(Path(__file__).resolve()), "--rank", "--precision", precision, "--device", device,
                             "--out", str(out), *cases], 2, timeout_s)
        results = json.loads(out.read_text()) if out.exists() else {}
    return results, ranks


def part_parity() -> dict:
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + 90))
    tables, judged, notes = {}, [], []
    for precision in PRECISIONS:
        left = deadline - time.time() - 5
        if left < 15:
            notes.append(f"{precision}: not run, the part's time box is spent")
            continue
        results, ranks = run_parity("cuda", PARITY_CASES, precision, left)
        rows = judge(results, PARITY_CASES)
        if not results:  # NCCL refused two ranks on one GPU, or a rank failed: say which, plainly
            refusal = next((r["log_tail"] for r in ranks if r["exit_code"] != 0), "")
            notes.append(f"{precision}: no result (exit codes {[r['exit_code'] for r in ranks]}): {refusal[-600:]}")
        tables["two ranks on one GPU, fp32 (judged)" if precision == "fp32" else
               f"two ranks on one GPU, {precision} (figures only, not judged)"] = rows
        if precision == "fp32":
            judged = rows
    ok = bool(judged) and all(r["holds"] for r in judged)
    return {"status": "ok" if ok else "failed", "tables": tables, "notes": notes,
            "summary": "; ".join(f"{r['case']} fp32 {'holds' if r['holds'] else 'MISSES: ' + r['mismatches']}"
                                 for r in judged) + (" " + " | ".join(notes) if notes else "")}


def _rank_main(argv: list[str]) -> None:
    """One rank: the worker's main, with the trainer's bf16 mixed precision off for fp32."""
    precision = argv[argv.index("--precision") + 1]
    rest = [a for i, a in enumerate(argv) if a != "--precision" and (i == 0 or argv[i - 1] != "--precision")]
    for path in ("contract", "operator", "trainer_image", "inference_image", "launcher"):
        sys.path.insert(0, str(ROOT / path))
    if precision == "fp32":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        import rlhf_trainer.parallel.parallelize as parallelize

        parallelize.MixedPrecisionPolicy = lambda **_: MixedPrecisionPolicy()  # no cast: fp32 compute
    worker = worker_module()
    sys.argv = [str(WORKER), *rest]
    worker.main()


if __name__ == "__main__" and "--rank" in sys.argv:
    _rank_main([a for a in sys.argv[1:] if a != "--rank"])
