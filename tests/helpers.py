"""What several test files need, defined once: free ports, torchrun launches of worker
scripts, the tiny model as plain Hugging Face. (Fixtures live in conftest.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlhf_launcher.local import free_port

__all__ = ["free_port", "hf_causal_lm", "torchrun"]


def torchrun(worker: Path, world: int, *args: str, out: Path, timeout: float = 400,
             env: dict[str, str] | None = None) -> dict:
    """Run `worker` under torchrun on `world` CPU processes (gloo); it writes its results as
    JSON to `out` (passed as `--out`). Returns them; fails the test with the workers' output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={free_port()}",
           str(worker), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def hf_causal_lm(path: Path):
    """The model of `path` through plain transformers, in eval mode (the reference the
    trainer's and the engines' numbers are checked against)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


# ---- the operator's pure functions: jobs and pods as the API server returns them ----------

def job_of(body: dict):
    """The validated RLHFJob of an API object (its status left out)."""
    import copy

    from rlhf_contract.api import validate_job

    return validate_job({k: copy.deepcopy(v) for k, v in body.items() if k != "status"})


def fake_pod(name: str, labels: dict[str, str], *, phase: str = "Running", ready: bool = True,
             exit_code: int | None = None, restarts: int = 0, node: str = "node-1") -> dict:
    """A pod as the API returns it: one container, running or terminated with `exit_code`."""
    cs = {"name": "c", "restartCount": restarts, "state": {"running": {}}}
    if exit_code is not None:
        cs["state"] = {"terminated": {"exitCode": exit_code, "reason": "Error", "message": "boom"}}
    return {"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": node},
            "status": {"phase": phase, "containerStatuses": [cs],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
