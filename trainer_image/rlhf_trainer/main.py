"""One trainer process under torchrun: read the config, join the world, build the run
loop, resume, run; clean up in `finally`. A failure's first line goes to the container's
termination message."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from rlhf_contract.exit_codes import ExitCode
from rlhf_contract.pod import ENV_OUTPUT_DIR, ENV_RESUME, ENV_ROLLOUT_ENDPOINTS, ENV_TRAINER_CONFIG, ENV_WEIGHT_SYNC_ADDR
from rlhf_contract.trainer_config import TrainerConfig

from .data.datasets import DataError
from .rewards.forms import RewardConfigError
from .storage import StorageError
from .distributed import collective_timeout_s, init_distributed
from .exits import mark_config_error, mark_exit_code, write_termination_message
from .preemption import STOP, Preempted
from .preflight import with_checkpointing_decided
from .weight_sync.threads import WeightSyncError, exit_process


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = TrainerConfig.from_json(Path(os.environ[ENV_TRAINER_CONFIG]).read_text())
    endpoints = [e for e in os.environ.get(ENV_ROLLOUT_ENDPOINTS, "").split(",") if e]
    if not endpoints and not config.method.offline:
        raise SystemExit(f"{ENV_ROLLOUT_ENDPOINTS} is empty: the trainer needs at least one rollout server")
    STOP.install(config.termination_grace_period_seconds)  # before anything slow: SIGTERM saves, never kills
    info = init_distributed(timeout_s=collective_timeout_s(config))
    output_dir = os.environ.get(ENV_OUTPUT_DIR) or config.output.dir or "/output"
    try:
        with documented_exits(info.rank):
            config = with_checkpointing_decided(config, info.world_size, info.device)  # once, before any model loads
            if not config.method.offline:
                from .rl.loop import RunLoop

                loop = RunLoop(config, info, endpoints=endpoints, weight_sync_addr=os.environ[ENV_WEIGHT_SYNC_ADDR],
                               output_dir=output_dir)
            else:  # sft, rm, dpo: from the data alone, no rollout servers
                from .offline.loop import OfflineLoop

                loop = OfflineLoop(config, info, output_dir=output_dir)
            if os.environ.get(ENV_RESUME, "1") == "1":
                loop.resume_if_possible()
            loop.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def documented_exits(rank: int) -> Iterator[None]:
    """How a failure ends the trainer process (`rlhf_contract.exit_codes`): a stop from
    outside exits 143 after its checkpoint; a config error (bad data, an upload refused, a
    `SystemExit(2)` such as a rollout image or an NCCL interface only the spec can fix) is
    marked for the launcher and exits 2; a failed weight sync exits 75 at once (exit_process);
    anything else propagates (exit 1). The first line goes to the termination message."""
    try:
        yield
    except Preempted as stopped:
        mark_exit_code(ExitCode.TERMINATED)  # torchrun would turn it into 1: the launcher passes it on
        logging.getLogger("rlhf_trainer").warning("%s", stopped)
        sys.exit(ExitCode.TERMINATED)
    except BaseException as err:
        if isinstance(err, (DataError, RewardConfigError)) or (isinstance(err, SystemExit) and err.code == ExitCode.CONFIG_ERROR) \
                or (isinstance(err, StorageError) and err.permanent):  # an upload refused: only the spec can fix it
            mark_config_error()  # the launcher exits 2: fail the job at once, no restart
        if not isinstance(err, KeyboardInterrupt):
            write_termination_message(f"rank {rank}: {type(err).__name__}: {err}".splitlines()[0])
        if isinstance(err, WeightSyncError):
            # The weight-sync group is dead and the other ranks wait in a collective for this one:
            # no teardown (it could hang); exit at once with a code the launcher passes on, so the
            # job restarts, its servers included (one may be left half-reloaded yet healthy).
            logging.getLogger("rlhf_trainer").error("weight sync failed: %s", err)
            logging.shutdown()
            exit_process(str(err))
        raise


if __name__ == "__main__":
    sys.exit(main())
