"""The trainer pod's command: check the config, then become torchrun.

    python -m rlhf_trainer.launch --nnodes=N --nproc-per-node=P [torchrun options]

reads RLHF_TRAINER_CONFIG, runs `preflight.check` and exits with code 2 naming the field
when the config cannot work; otherwise it execs `python -m torch.distributed.run <options>
-m rlhf_trainer`, so torchrun's exit code is the container's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlhf_contract.pod import ENV_TRAINER_CONFIG
from rlhf_contract.trainer_config import TrainerConfig

from .preflight import EXIT_CONFIG_ERROR, check, write_termination_message


def _option(args: list[str], name: str, default: int) -> int:
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return int(arg.split("=", 1)[1].split(":")[-1])
        if arg == name and i + 1 < len(args):
            return int(args[i + 1].split(":")[-1])
    return default


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config = TrainerConfig.from_json(Path(os.environ[ENV_TRAINER_CONFIG]).read_text())
        problems = check(config, _option(args, "--nnodes", 1) * _option(args, "--nproc-per-node", 1))
    except KeyError:
        problems = [f"{ENV_TRAINER_CONFIG} is not set: the trainer needs its config file"]
    except (OSError, ValueError) as err:
        problems = [f"{ENV_TRAINER_CONFIG}: cannot read the trainer config ({err})"]
    if problems:
        message = "config error: " + "; ".join(problems)
        print(message, file=sys.stderr, flush=True)
        write_termination_message(message)
        return EXIT_CONFIG_ERROR
    command = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "rlhf_trainer"]
    os.execv(sys.executable, command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
