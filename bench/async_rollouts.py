"""Step time of synchronous rollouts (rollout.maxStaleness = 0) against bounded off-policy
ones (k = 1), in one run: the demo job in local mode (built-in tiny Qwen2, 1 CPU rollout
server, 1 trainer process), with enough samples per step that generation and training
take similar time. Prints each mean step time (steps after the first few), the ratio
k=1 / k=0 (ideal 0.5 when the two phases are equal and the machine has a core for each),
and where the k=0 step goes.

    .venv/bin/python bench/async_rollouts.py [--steps 30] [--k 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 4  # start-up steps left out


def run(out: Path, steps: int, k: int, extra: list[str]) -> list[dict]:
    sets = [f"schedule.totalSteps={steps}", "schedule.saveEvery=0", "rollout.replicas=1", f"rollout.maxStaleness={k}",
            *extra]
    cmd = [sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples" / "local-grpo.yaml"),
           "--output", str(out), *[a for s in sets for a in ("--set", s)]]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--set", action="append", default=["rollout.samplesPerPrompt=16", "rollout.maxTokens=8",
                                                           "schedule.promptsPerStep=16"],
                        help="extra spec overrides (the default balances rollout and training on 2 cores)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(Path(tmp) / "k0", args.steps, 0, args.set)[SKIP:]
        ahead = run(Path(tmp) / f"k{args.k}", args.steps, args.k, args.set)[SKIP:]
    mean = lambda rows, key: statistics.mean(r[key] for r in rows)  # noqa: E731
    s0, s1 = mean(sync, "step_seconds"), mean(ahead, "step_seconds")
    print(f"k=0: {s0:.3f} s/step (rollout {mean(sync, 'rollout_seconds'):.3f}, train {mean(sync, 'train_seconds'):.3f}, "
          f"weight sync {mean(sync, 'weight_sync_seconds'):.3f})")
    print(f"k={args.k}: {s1:.3f} s/step (waiting for rollouts {mean(ahead, 'rollout_seconds'):.3f}, "
          f"train {mean(ahead, 'train_seconds'):.3f}; staleness mean {mean(ahead, 'staleness_mean'):.2f})")
    print(f"ratio k={args.k} / k=0: {s1 / s0:.2f}  (ideal 0.5 with equal phases)")


if __name__ == "__main__":
    main()
