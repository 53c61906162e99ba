"""Builds the rollout server command from the job spec (pure; no heavy imports).

`vllm serve` for GPUs, with the weight-transfer engine on NCCL; or the built-in CPU
engine (`python -m rlhf_inference.cpu_engine`) that speaks the same HTTP protocol.
`python -m rlhf_inference.launch` reads RLHF_JOB_CONFIG and execs the command in a pod.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_operator.api.models import RLHFJobSpec


def serve_command(spec: "RLHFJobSpec", *, model_path: str, host: str, port: int, name: str, python: str = "python") -> list[str]:
    r = spec.rollout
    if r.engine == "cpu":
        return [
            python, "-m", "rlhf_inference.cpu_engine", "--model", model_path, "--host", host,
            "--port", str(port), "--seed", str(spec.schedule.seed), "--served-model-name", name,
        ]
    return [
        "vllm", "serve", model_path, "--host", host, "--port", str(port),
        "--served-model-name", name,
        "--tensor-parallel-size", str(r.tensor_parallel_size),
        "--dtype", spec.model.dtype,
        "--seed", str(spec.schedule.seed),
        "--max-model-len", str(spec.data.max_prompt_length + r.max_tokens),
        "--weight-transfer-config", json.dumps({"backend": "nccl"}),
    ]


def main() -> None:
    from rlhf_operator.api.models import RLHFJob

    job = RLHFJob.model_validate(json.loads(open(os.environ["RLHF_JOB_CONFIG"]).read()))
    port = int(os.environ.get("RLHF_ROLLOUT_PORT", "8000"))
    cmd = serve_command(job.spec, model_path=job.spec.model.path, host="0.0.0.0", port=port, name=job.metadata.name, python=sys.executable)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
