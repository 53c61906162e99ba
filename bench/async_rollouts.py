"""Placements and staleness at equal resources: step time of the demo job (built-in tiny
Qwen2, one CPU rollout server, one trainer process) in three modes, with the machine's cores
standing in for GPUs and each process pinned to its cores (`taskset`), as devices are on a
cluster:

  separate k=0   server on half the cores, trainer on the other half; generate, then train
                 (each phase leaves the other half idle)
  separate k=1   the same split, the next step's rollouts generated while the trainer trains
                 (rollout.maxStaleness = 1)
  colocated      server and trainer on ALL the cores, taking turns (rollout.placement =
                 colocated: the server sleeps while the trainer trains)
  separate k=2   two steps ahead (rollout.maxStaleness = 2)
  ... in-flight  the same with rollout.inFlightUpdates: a weight push pauses the server with
                 mode "keep" (its requests go on with the new weights) instead of "wait"
                 (the push waits for the requests in flight to finish), and a step takes the
                 first groups to complete from a pool kept generating (partial rollouts,
                 orchestrator/partial.py)

`--long-tail` lets responses run to 64 tokens (`rollout.maxTokens`; the demo default is 8)
at a learning rate that leaves the model as it is: the untrained model ends a response
with EOS at a roughly constant rate per token, so the lengths are geometric, most short and
a few 4-5x the mean, and with "wait" the longest response in flight sets when a push can
start. `--modes` picks modes by name.

Prints each mean step time (steps after the first few), where the time goes, and the ratios
to separate k=0. On 2 cores each side of the split has one core: separate k=1 can at best
halve the step when the phases are equal; colocated gives each phase both cores.

    .venv/bin/python bench/async_rollouts.py [--steps 30] [--long-tail] [--modes "separate k=1,separate k=1 in-flight"]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
SKIP = 4  # start-up steps left out
MODES = {"separate k=0": ("separate", 0, False), "separate k=1": ("separate", 1, False),
         "colocated": ("colocated", 0, False), "separate k=1 in-flight": ("separate", 1, True),
         "separate k=2": ("separate", 2, False), "separate k=2 in-flight": ("separate", 2, True)}
LONG_TAIL = ["rollout.maxTokens=64", "trainer.learningRate=1e-7"]
"""Long responses, and a learning rate too small to teach the model to stop early: the
length distribution stays the untrained model's for the whole run (timing, not learning)."""


def free_port() -> int:
    from rlhf_launcher.local import free_port as port

    return port()


@contextlib.contextmanager
def server(model_dir: Path, cores: list[int], sleep_mode: bool, log: Path):
    port = free_port()
    cmd = ["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-m", "rlhf_inference.cpu_engine",
           "--model", str(model_dir), "--port", str(port), "--num-threads", str(len(cores)),
           "--served-model-name", "bench", "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs",
           *(["--enable-sleep-mode"] if sleep_mode else [])]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run(tmp: Path, name: str, steps: int, extra: list[str], model_dir: Path) -> list[dict]:
    from rlhf_contract.api import load_job
    from rlhf_contract.trainer_config import TrainerConfig

    placement, k, in_flight = MODES[name]
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    server_cores, trainer_cores = (cores, cores) if placement == "colocated" else (cores[:half], cores[half:] or cores)
    sets = [f"schedule.totalSteps={steps}", "schedule.saveEvery=0", "rollout.replicas=1",
            f"rollout.maxStaleness={k}", f"rollout.placement={placement}", f"model.path={model_dir}",
            f"rollout.inFlightUpdates={str(in_flight).lower()}", *extra]
    job = load_job(ROOT / "examples" / "local-grpo.yaml", sets)
    out = tmp / name.replace(" ", "-").replace("=", "")
    out.mkdir()
    config = out / "trainer.json"
    config.write_text(TrainerConfig.from_job(job).to_json())
    with server(model_dir, server_cores, placement == "colocated", out / "server.log") as url:
        env = {**os.environ, "RLHF_TRAINER_CONFIG": str(config), "RLHF_ROLLOUT_ENDPOINTS": url,
               "RLHF_WEIGHT_SYNC_ADDR": f"127.0.0.1:{free_port()}", "RLHF_OUTPUT_DIR": str(out),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": str(len(trainer_cores))}
        cmd = ["taskset", "-c", ",".join(map(str, trainer_cores)), sys.executable, "-m", "rlhf_trainer"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{name}: {res.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--set", action="append", default=["rollout.samplesPerPrompt=16", "rollout.maxTokens=8",
                                                           "schedule.promptsPerStep=16"],
                        help="extra spec overrides (the default balances rollout and training on 2 cores)")
    parser.add_argument("--long-tail", action="store_true", help="responses up to 64 tokens, geometric lengths")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated mode names (default: all)")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",")]
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    extra = args.set + (LONG_TAIL if args.long_tail else [])
    from rlhf_trainer.models.builtin import materialize

    job = yaml.safe_load((ROOT / "examples" / "local-grpo.yaml").read_text())
    mean = lambda rows, key: statistics.mean(r[key] for r in rows)  # noqa: E731
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize(job["spec"]["model"]["path"], Path(tmp) / "model", seed=job["spec"]["schedule"]["seed"])
        for name in modes:
            results[name] = run(Path(tmp), name, args.steps, extra, model_dir)[SKIP:]
    base_name = modes[0]
    base = mean(results[base_name], "step_seconds")
    print(f"{len(os.sched_getaffinity(0))} cores; mean of steps {SKIP + 1}-{args.steps}; {' '.join(extra)}")
    for name, rows in results.items():
        step = mean(rows, "step_seconds")
        lengths = (f"response length mean {mean(rows, 'response_length_mean'):.1f} "
                   f"max {max(r['response_length_max'] for r in rows)}")
        mixed = (f", mixed-version responses {mean(rows, 'mixed_version_fraction'):.2f}, staleness mean "
                 f"{mean(rows, 'staleness_mean'):.2f}, stale tokens masked {mean(rows, 'stale_token_fraction'):.3f}"
                 if "mixed_version_fraction" in rows[0] else "")
        print(f"{name:22s} {step:.3f} s/step  x{step / base:.2f} of {base_name}  (rollout {mean(rows, 'rollout_seconds'):.3f}, "
              f"train {mean(rows, 'train_seconds'):.3f}, weight sync {mean(rows, 'weight_sync_seconds'):.3f}; "
              f"{lengths}{mixed})")


if __name__ == "__main__":
    main()
