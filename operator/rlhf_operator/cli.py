"""`rlhfctl`: run a job locally, validate a job file, print the CRD."""

from __future__ import annotations

import argparse
import sys


def _cmd_validate(args: argparse.Namespace) -> int:
    from .api import JobError, load_job

    try:
        job = load_job(args.job, args.set)
    except JobError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{args.job}: valid RLHFJob {job.metadata.name!r}")
    return 0


def _cmd_crd(args: argparse.Namespace) -> int:
    from .api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .api import JobError, load_job
    from .local import LocalRunError, run_local

    try:
        job = load_job(args.job, args.set)
    except JobError as err:
        print(err, file=sys.stderr)
        return 1
    try:
        return run_local(job, output=args.output, resume=args.resume, overwrite=args.overwrite)
    except LocalRunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhfctl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_job_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("job", help="RLHFJob YAML file")
        p.add_argument(
            "--set", action="append", default=[], metavar="FIELD=VALUE",
            help="override a spec field, e.g. --set rollout.replicas=2 (repeatable)",
        )

    run = sub.add_parser("run", help="run a job on this machine (local mode)")
    add_job_args(run)
    run.add_argument("--output", help="output directory (default: spec.output.dir or runs/<name>)")
    run.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    run.add_argument("--overwrite", action="store_true", help="start afresh in an output directory that has checkpoints")
    run.set_defaults(func=_cmd_run)

    validate = sub.add_parser("validate", help="check a job file and report every problem")
    add_job_args(validate)
    validate.set_defaults(func=_cmd_validate)

    crd = sub.add_parser("crd", help="print the RLHFJob CustomResourceDefinition")
    crd.set_defaults(func=_cmd_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
