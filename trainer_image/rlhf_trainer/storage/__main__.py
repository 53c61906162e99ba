"""`python -m rlhf_trainer.storage --plan JSON [--cache DIR] [--restore S3_URI --output DIR]`: the download
step (rlhf_contract.pod.fetch_process). Exit 0 when every copy is complete, 2 (naming the
field and the Secret) when only a change to the spec or the Secret can help, 1 when the
next attempt may succeed."""

from __future__ import annotations

import argparse
import logging
import sys

from rlhf_contract.exit_codes import ExitCode
from rlhf_contract.sources import plan_from_json

from . import StorageError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_trainer.storage")
    parser.add_argument("--plan", default="[]", help="the downloads (rlhf_contract.sources.plan_json)")
    parser.add_argument("--restore", help="spec.output.uri: copy its newest complete checkpoint into --output "
                                          "when that holds none")
    parser.add_argument("--output", help="the output directory")
    parser.add_argument("--cache", help="spec.sourceCache's mount: keep each copy there once, by content, and "
                                        "link the job's sources to it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "httpx2", "huggingface_hub"):  # one line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from ..exits import write_termination_message
    from .fetch import fetch_all
    from .publish import restore_checkpoint

    try:
        for line in fetch_all(plan_from_json(args.plan), args.cache):
            print(line, flush=True)
        if args.restore:
            print(restore_checkpoint(args.restore, args.output), flush=True)
    except StorageError as err:
        message = ("config error: " if err.permanent else "download failed: ") + str(err)
        print(message, file=sys.stderr, flush=True)
        write_termination_message(message)
        return ExitCode.CONFIG_ERROR if err.permanent else ExitCode.FAILED
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
