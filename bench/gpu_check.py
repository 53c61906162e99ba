"""`make gpu-check`: everything a lent GPU machine should tell us, in one command and one
report (docs/testing.md gives the exact device call).

    python bench/gpu_check.py                 # report into $OUT if set, else runs/gpu-check/
    python bench/gpu_check.py --parts nccl,attention

Eleven parts (bench/gpu_check_parts.py and the files it names), each in a process of its own
with a time box, so a part that fails, hangs or crashes the CUDA context loses only its own
result. They run in the order of issue 50's list, the parts of the first run last:
  pair        the real sender (launcher, trainer main, WeightSyncSender) to one and then two
              receiving processes on the same GPU (each its own NCCL_HOSTID: NCCL's network
              transport on loopback), a 1.5B-shaped bf16 set: sha256 of every tensor on both
              sides, GB/s labelled by the network NCCL chose ("Using network ...");
  failures    on that pair: a receiver killed and one stopped mid-transfer, one that never
              joins (exit 75 each), a bad NCCL_SOCKET_IFNAME (exit 2), each within its deadline;
  ipc         CUDA IPC weight transfer to a second process on the GPU, as colocated vLLM
              servers take weights (weight_sync/ipc.py): bit for bit, GB/s;
  parity      the CPU parity tests' worker on two ranks of the one GPU (each with its own
              NCCL_HOSTID), FSDP2 2x1x1 and context parallel 1x1x2 GRPO against one process,
              judged by the CPU tests' tolerances (gpu_check_parity.py);
  memory      the memory plan against the allocator's peaks under a rule fixed before the
              run: checkpointing at 16k and 32k tokens, ten steps of varying lengths, two
              ranks (gpu_check_memory.py);
  engines     DeepSpeed ZeRO-2 and ZeRO-3 and LoRA, a few steps each, world 1: the step
              completes with a finite loss, the peak memory (deepspeed feature-detected);
  throughput  tokens/s and MFU of our train step at the 1.5B shape against plain Hugging
              Face training of the same shape, like for like: both unpadded, both with and
              without activation checkpointing (bench/train_throughput.py);
  gpu-tests   pytest's junit report of the gpu-marked tests, into $OUT;
  nccl        our libnccl binding and NcclTransport on CUDA, a world-size-1 communicator:
              connect, bf16 buckets, synchronize, a whole sender round, close, the abort path;
  attention   packed attention (varlen_attn where this torch has it, feature-detected)
              in bf16 against fp32 SDPA with GQA, forward and backward;
  demo        the demo job (examples/local-grpo.yaml) with its trainer on CUDA.
Without CUDA every part is reported as skipped ("no GPU") and nothing else runs.

Writes gpu-check.json (everything) and gpu-check.md (the figures as tables). The whole run
stays under TOTAL_S: 510 s, the device call's 600 less the wheels' install. The boxes add
up to more: what the budget leaves out is reported as skipped, and rerun with --parts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TOTAL_S = 510
"""The whole check's budget; each part gets min(its box, what is left)."""
PARTS: dict[str, int] = {"pair": 120, "failures": 150, "ipc": 45, "parity": 90, "memory": 150, "engines": 90,
                         "throughput": 150, "gpu-tests": 120, "nccl": 60, "attention": 60, "demo": 140}
"""Each part's time box in seconds, in the order they run."""
DEADLINE_ENV = "GPU_CHECK_DEADLINE"
"""Given to each part: the epoch second its box ends (the demo stops its job before it)."""


def child_command(name: str, result: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(result)]


def run_part(name: str, command: list[str], result: Path, timeout_s: float) -> dict:
    """Run one part's process; its own JSON result, or why there is none."""
    start = time.monotonic()
    env = {**os.environ, DEADLINE_ENV: str(time.time() + timeout_s)}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group: a timeout ends all it started
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return {"status": "timed out", "seconds": round(time.monotonic() - start, 1), "timeout_s": timeout_s,
                "stderr_tail": (stderr or "")[-3000:]}
    seconds = round(time.monotonic() - start, 1)
    try:
        data = json.loads(result.read_text())
    except (OSError, ValueError):
        return {"status": "failed", "seconds": seconds, "exit_code": proc.returncode,
                "stderr_tail": (stderr or "")[-3000:]}
    return {**data, "seconds": seconds}


def machine() -> dict:
    info: dict = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # noqa: BLE001  (the report says what went wrong)
        info["torch_error"] = repr(exc)
    if info.get("gpus"):  # from nvidia-smi: no CUDA context in this process (the parts measure device memory)
        try:
            line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                   "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
            info["gpu"], info["gpu_memory"], info["driver"] = [x.strip() for x in line.splitlines()[0].split(",")]
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            info["gpu"] = "unknown (nvidia-smi did not answer)"
    return info


def run_all(names: list[str], out_dir: Path, *, command=child_command, total_s: float = TOTAL_S,
            boxes: dict[str, int] | None = None) -> dict:
    """Every part in turn (skipped without CUDA); the report, also written to `out_dir`."""
    boxes = boxes or PARTS
    report = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parts": {}}
    deadline = time.monotonic() + total_s
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if not report["machine"].get("gpus"):
                report["parts"][name] = {"status": "skipped", "reason": "no GPU: torch.cuda.is_available() is False"}
                continue
            left = deadline - time.monotonic()
            if left < 10:
                report["parts"][name] = {"status": "skipped", "reason": f"the check's {total_s} s budget is spent"}
                continue
            result = Path(tmp) / f"{name}.json"
            report["parts"][name] = run_part(name, command(name, result), result, min(boxes[name], left))
            print(f"gpu-check: {name}: {report['parts'][name]['status']} "
                  f"({report['parts'][name].get('seconds', 0)} s)", flush=True)
            write_report(report, out_dir, deadline - total_s)  # a device call cut at its limit keeps what ran
    write_report(report, out_dir, deadline - total_s)
    return report


def write_report(report: dict, out_dir: Path, started: float) -> None:
    report["seconds"] = round(time.monotonic() - started, 1)
    (out_dir / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "gpu-check.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# gpu-check {report['started']}", "",
             f"{m.get('gpu', 'no GPU')}, torch {m.get('torch')} (CUDA {m.get('cuda')}), Python {m.get('python')}", "",
             "| part | status | seconds | figures |", "|---|---|---|---|"]
    for name, part in report["parts"].items():
        figures = part.get("summary") or part.get("reason") or part.get("error") or ""
        lines.append(f"| {name} | {part['status']} | {part.get('seconds', '')} | {figures} |")
    for name, part in report["parts"].items():
        for title, rows in part.get("tables", {}).items():
            if rows:
                lines += ["", f"## {name}: {title}", "", "| " + " | ".join(rows[0]) + " |",
                          "|" + "---|" * len(rows[0])]
                lines += ["| " + " | ".join(str(row.get(k, "")) for k in rows[0]) + " |" for row in rows]
        if part.get("stderr_tail"):
            lines += ["", f"## {name}: stderr (tail)", "", "```", part["stderr_tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS))
    parser.add_argument("--out", default=None, help="report directory (default: $OUT, else runs/gpu-check)")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a child: run this part only
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        sys.path.insert(0, str(BENCH))
        from gpu_check_parts import run_child

        return run_child(args.part, Path(args.result))
    names = [n for n in args.parts.split(",") if n]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)} (known: {', '.join(PARTS)})")
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu-check")
    report = run_all(names, out_dir)
    print((out_dir / "gpu-check.md").read_text())
    return 0 if all(p["status"] in ("ok", "skipped") for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
