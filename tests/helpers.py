"""What several test files need, defined once: free ports, torchrun launches of worker
scripts, the tiny model as plain Hugging Face. (Fixtures live in conftest.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlhf_launcher.local import free_port

__all__ = ["free_port", "hf_causal_lm", "torchrun", "ScriptedPolicy", "PromptList"]


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


# ---- tool-calling and agent episodes: a scripted policy in place of the rollout servers ----

class ScriptedPolicy:
    """The rollout client's `generate`, scripted (for the tools tokenizer's chat template): the
    episode of prompt "a+b=" plays SCRIPTS[a+b=][turn] (turn = assistant turns already in the
    sequence); log-probs are distinct per token, and every emitted sample is kept."""

    def __init__(self, tok, scripts: dict[str, list[str]], delay_s: float = 0.0):
        self.tok, self.scripts, self.delay_s = tok, scripts, delay_s
        self.emitted: dict[str, list] = {k: [] for k in scripts}
        self.in_flight = self.most_in_flight = 0

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    async def generate(self, prompts, *, n, max_tokens, seed, **_):
        import asyncio

        from rlhf_trainer.models.builtin import IM_END
        from rlhf_trainer.rollout.client import Sample

        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        [prompt] = prompts
        text = self.tok.decode(prompt, skip_special_tokens=False)
        key = text.split("user\n", 1)[1].split(IM_END, 1)[0]
        turn = text.count("<|im_start|>assistant") - 1
        ids = self.ids(self.scripts[key][turn])[:max_tokens]
        base = -0.01 * (len(self.emitted[key]) + 1)
        sample = Sample(list(prompt), ids, [base - 0.001 * k for k in range(len(ids))],
                        "length" if len(ids) == max_tokens else "stop")
        self.emitted[key].append(sample)
        return [[sample]]


class PromptList:
    """The orchestrator's prompt source over fixed (prompt, answer) pairs."""

    def __init__(self, prompts: list[tuple[str, str]]):
        self.prompts, self.position = prompts, 0

    def next_batch(self, n):
        from rlhf_trainer.data.rendering import PromptRecord

        self.position += n
        return [PromptRecord(p, [], a, {"prompt": p, "answer": a}) for p, a in self.prompts[:n]]
