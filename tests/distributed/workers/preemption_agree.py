"""torchrun worker: `STOP.agree` on 2 gloo processes when only rank 1 gets SIGTERM (a drain of
one node): every rank must reach the same decision. Rank 0 writes the decisions as JSON."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from rlhf_trainer.preemption import STOP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, cpu = dist.get_rank(), torch.device("cpu")
    STOP.install(30)
    before = STOP.agree(needed_s=1.0, device=cpu)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes the time
        time.sleep(0.2)
    after = STOP.agree(needed_s=10.0 * (rank + 1), device=cpu)
    if rank == 1:
        STOP.grace_s = 5.0  # now the time left (about 5 s) is below what rank 1 says it needs (20 s)
    short = STOP.agree(needed_s=10.0 * (rank + 1), device=cpu)
    decisions = [None] * dist.get_world_size()
    dist.all_gather_object(decisions, [vars(d) | {"abandon": d.abandon} for d in (before, after, short)])
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(decisions, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
