"""The trainer pod's command: check the config, then run torchrun (or, for a world of one
process, the trainer itself).

    python -m rlhf_trainer.launch --nnodes=N --nproc-per-node=P [torchrun options]

reads RLHF_TRAINER_CONFIG, runs `preflight.check` and exits with code 2 naming the field
when the config cannot work; otherwise it runs `python -m torch.distributed.run <options>
-m rlhf_trainer` as its child (forwarding SIGTERM / SIGINT) and exits with torchrun's code,
except that a worker which found a config error only it could see (e.g. a rollout server
image without weight transfer) or whose weight sync failed leaves its exit code in a marker
file (exits.py), and the launcher then exits with it (2, or 75 to restart the job with its
servers; `rlhf_contract.exit_codes`): torchrun itself turns every worker failure into 1. On nodes other than the first it also
answers Prometheus (`serve_node_endpoint`). In a pod it keeps a copy of the child's output on
the job's volume, one file per attempt and pod (podlog.py).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import tempfile
from pathlib import Path

from rlhf_contract.exit_codes import ExitCode
from rlhf_contract.pod import ENV_METRICS_PORT, ENV_TRAINER_CONFIG
from rlhf_contract.trainer_config import TrainerConfig

from .exits import ENV_CONFIG_ERROR_FILE, marked_exit_code, write_termination_message
from .podlog import popen_kept
from .preflight import check


ENV_CHECKED_CONFIG = "RLHF_CHECKED_CONFIG"
"""`rlhfctl run` (local mode) sets it to the `config_digest` of the trainer config it has just
passed through the same `preflight.check` for the same world: the launcher then skips its own
check of that very file (seconds of imports and tokenizer loading, on every attempt). Nothing
sets it in a pod, where the check always runs; any other file is checked."""


def config_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _option(args: list[str], name: str, default: int) -> int:
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return int(arg.split("=", 1)[1].split(":")[-1])
        if arg == name and i + 1 < len(args):
            return int(args[i + 1].split(":")[-1])
    return default


def serve_node_endpoint(args: list[str]) -> int | None:
    """On every node but the first: answer Prometheus on RLHF_METRICS_PORT with no step
    series, so a monitor that selects every trainer pod finds none "down" (node 0's rank-0
    process serves the step metrics there). Returns the port served, or None."""
    port = int(os.environ.get(ENV_METRICS_PORT) or 0)
    node_rank = int(os.environ.get("PET_NODE_RANK") or _option(args, "--node-rank", 0))
    if not port or node_rank == 0:
        return None
    from prometheus_client import CollectorRegistry, start_http_server

    start_http_server(port, registry=CollectorRegistry())
    return port


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        path = Path(os.environ[ENV_TRAINER_CONFIG])
        config = TrainerConfig.from_json(path.read_text())
        checked = os.environ.get(ENV_CHECKED_CONFIG) == config_digest(path)
        problems = [] if checked else check(config, _option(args, "--nnodes", 1) * _option(args, "--nproc-per-node", 1))
    except KeyError:
        problems = [f"{ENV_TRAINER_CONFIG} is not set: the trainer needs its config file"]
    except (OSError, ValueError) as err:
        problems = [f"{ENV_TRAINER_CONFIG}: cannot read the trainer config ({err})"]
    if problems:
        message = "config error: " + "; ".join(problems)
        print(message, file=sys.stderr, flush=True)
        write_termination_message(message)
        return ExitCode.CONFIG_ERROR
    serve_node_endpoint(args)
    marker = Path(tempfile.mkdtemp(prefix="rlhf-launch-")) / "config-error"
    env = {**os.environ, ENV_CONFIG_ERROR_FILE: str(marker)}
    if _option(args, "--nnodes", 1) * _option(args, "--nproc-per-node", 1) == 1:
        # a world of one needs no elastic agent: the trainer directly, ~3 s of torchrun's start-up saved
        command = [sys.executable, "-m", "rlhf_trainer"]
        env.update(single_process_env())
    else:
        command = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "rlhf_trainer"]
    child, finish = popen_kept(command, env)  # in a pod: its log also on the job's volume (podlog.py)
    for sig in (signal.SIGTERM, signal.SIGINT):  # torchrun (or the trainer) passes it on and waits the grace period
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    finish()
    if code < 0:  # killed by a signal (torchrun would have said 1): the shell's 128 + signal
        code = 128 - code
    if code != 0:
        marked = marked_exit_code(marker)
        if marked is not None:
            return marked
    return code


def single_process_env() -> dict[str, str]:
    """What torchrun would give the one worker of a world of one, on a free loopback port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


if __name__ == "__main__":
    sys.exit(main())
