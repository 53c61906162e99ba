"""`rlhfctl`: run a job locally, validate a job file, plan its GPU memory, render the
manifests the operator would create for it, submit it to a cluster and follow it there
(get, logs, delete), export a checkpoint as a model, plot runs' metrics, print the CRD."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rlhf_contract.exit_codes import ExitCode


def _emit_plan(job, world: int, gpu: int, verdict, fmt: str) -> int:
    """`plan -o json|yaml`: the plan's numbers (bytes), and the same exit code as the table."""
    from .output import emit

    result = verdict.plan
    emit({"name": job.metadata.name, "gpus": world, "gpuBytes": gpu, "fits": not verdict.problem, "totalBytes": result.total,
          "peakPhase": result.peak_phase, "maxTokensPerMicroBatch": result.tokens,
          "activationCheckpointing": result.activation_checkpointing,
          "terms": [{"name": t.name, "phase": t.phase, "bytes": t.bytes, "note": t.note} for t in result.terms],
          "notes": list(result.notes), "message": verdict.problem or None}, fmt)
    return ExitCode.CONFIG_ERROR if verdict.problem else ExitCode.OK


def _plan_gpu_bytes(args: argparse.Namespace, config, job) -> tuple[int | None, str]:
    """The memory of one trainer GPU and where it came from: --gpu-memory-gib, then
    trainer.gpuMemoryGiB, then the GPU product the job's pods select (a known
    `nvidia.com/gpu.product`), then this machine's GPU. ("" when given; the reason in the
    second item when none.)"""
    from rlhf_trainer.preflight.gpu_products import GPU_PRODUCT_LABEL, selected_gpu_bytes
    from rlhf_trainer.preflight.memory_plan import detect_gpu_bytes, gib

    size = args.gpu_memory_gib or config.optim.gpu_memory_gib
    if size:
        return gib(size), ""
    selected = selected_gpu_bytes(job.spec.pod.node_selector)
    if selected is not None:
        return selected[0], f" ({GPU_PRODUCT_LABEL}: {selected[1]})"
    product = (job.spec.pod.node_selector or {}).get(GPU_PRODUCT_LABEL)
    unknown = f", and spec.pod.nodeSelector's {GPU_PRODUCT_LABEL} {product!r} is not a product we know" if product else ""
    here = detect_gpu_bytes()
    return (here, " (this machine's GPU)") if here is not None else (None, unknown)


def _cmd_plan(args: argparse.Namespace) -> int:
    """The trainer's GPU memory plan (rlhf_trainer/preflight/memory_plan.py) for a job: a table, and
    exit 2 with the preflight's message when it does not fit; exit 1 without torch (the `plan` extra)."""
    from rich.console import Console
    from rich.table import Table

    from rlhf_contract.api import JobError, load_job
    from rlhf_contract.trainer_config import TrainerConfig
    from rlhf_trainer.preflight.memory_colocated import memory_verdict
    from rlhf_trainer.preflight.memory_plan import GIB

    from .installed import PLAN_EXTRA, torch_installed
    from .validate import model_config_here

    try:
        job = load_job(args.job, args.set)
    except JobError as err:
        print(err, file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    if not torch_installed():
        print("error: rlhfctl plan measures the model with torch (on its meta device: no weights, no GPU) and torch "
              f"is not installed here: {PLAN_EXTRA}", file=sys.stderr)
        return ExitCode.FAILED
    config = TrainerConfig.from_job(job)
    t = job.spec.trainer
    world = args.gpus or t.num_nodes * t.nproc_per_node
    gpu, source = _plan_gpu_bytes(args, config, job)
    if gpu is None:
        print(f"error: no GPU here to read its memory from{source}: give --gpu-memory-gib N (or set "
              "trainer.gpuMemoryGiB)", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    try:
        model = (json.loads(Path(args.model_config).read_text()) if args.model_config
                 else model_config_here(job.spec.model.path, hub=True))
        rm = model_config_here(job.spec.reward.model.path, hub=True) if job.spec.reward.model is not None else None
        verdict = memory_verdict(config, model, world, gpu, reward_model_config=rm)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    result = verdict.plan
    if args.output_format:
        return _emit_plan(job, world, gpu, verdict, args.output_format)
    p = config.optim.parallelism
    table = Table(title=f"{job.metadata.name}: memory per GPU, {world} trainer GPUs of {gpu / GIB:.1f} GiB{source} "
                        f"(tensorParallel {p.tensor_parallel}, contextParallel {p.context_parallel}, "
                        f"maxTokensPerMicroBatch {result.tokens}, activation checkpointing "
                        f"{'on' if result.activation_checkpointing else 'off'})")
    table.add_column("term")
    table.add_column("when")
    table.add_column("GiB", justify="right")
    table.add_column("how", overflow="fold")
    for term in result.terms:
        table.add_row(term.name, term.phase, f"{term.bytes / GIB:.2f}", term.note)
    table.add_section()
    table.add_row("total (peak)", result.peak_phase, f"{result.total / GIB:.1f}",
                  "CUDA context and NCCL + fragmentation margin included", style="bold")
    console = Console(width=max(Console().width, 120))
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    return _colocated_plan(console, verdict, gpu)


def _colocated_plan(console, verdict, gpu: int) -> int:
    """A colocated job's phases (rlhf_trainer/preflight/memory_colocated.py) after the
    trainer's table; exit 2 with the preflight's own problem (`memory_verdict`) when the
    job does not fit."""
    from rich.table import Table

    from rlhf_trainer.preflight.memory_plan import GIB

    phases = verdict.phases
    if phases:
        table = Table(title="rollout.placement colocated: the trainer and a server's worker on each GPU, in turns")
        for column in ("phase", "GiB", "what"):
            table.add_column(column, justify="right" if column == "GiB" else "left", overflow="fold")
        for phase in phases:
            table.add_row(phase.name, f"{phase.bytes / GIB:.1f}", phase.note)
        console.print(table)
    if verdict.problem:
        print(verdict.problem, file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    console.print(f"fits: {verdict.peak / GIB:.1f} of {gpu / GIB:.1f} GiB per GPU")
    return 0


def _cmd_crd(args: argparse.Namespace) -> int:
    from rlhf_contract.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from rlhf_contract.api import JobError, load_job
    from .local import LocalConfigError, LocalRunError, run_local

    try:
        job = load_job(args.job, args.set)
    except JobError as err:
        print(err, file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    try:
        return run_local(job, output=args.output, resume=args.resume, overwrite=args.overwrite)
    except LocalRunError as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR if isinstance(err, LocalConfigError) else ExitCode.FAILED


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import PlotError, plot_runs

    try:
        path = plot_runs(args.run_dirs, args.output)
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    print(path)
    return 0


PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


def _cmd_render(args: argparse.Namespace) -> int:
    """The children the operator creates for this job (its own builders, attempt 0), as
    YAML documents (or a JSON List): for review before `kubectl apply` (GitOps). The job's uid
    is only known once the API server has it: `--uid` (owner references, pod labels) or a placeholder."""
    from rlhf_contract.api import JobError, load_job
    from rlhf_operator.backends import build_support, build_workloads, job_settings
    from rlhf_operator.builders.pods import PodSettingsError
    from .output import dump_objects

    try:
        job = load_job(args.job, [*args.set, *([f"backend={args.backend}"] if args.backend else [])])
    except JobError as err:
        print(err, file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    extra = dict(job.metadata.model_extra or {})
    extra["uid"] = args.uid or extra.get("uid") or PLACEHOLDER_UID
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={
        "namespace": args.namespace or job.metadata.namespace or "default"})})
    job.metadata.__pydantic_extra__.update(extra)
    try:
        settings = job_settings(job, allow_host_path=args.allow_host_path)  # and what the backend cannot carry
    except PodSettingsError as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    objects = [*build_support(job, settings), *build_workloads(job, args.attempt, settings)]
    sys.stdout.write(dump_objects(objects, args.output_format or "yaml"))
    return ExitCode.OK


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import ExportError, export_checkpoint

    try:
        path = export_checkpoint(args.checkpoint, args.out, model=args.model, overwrite=args.overwrite)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    print(path)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from rlhf_contract.images import TRAINER_IMAGE, VLLM_VERSION

    try:
        ours = version("rlhf-operator")
    except PackageNotFoundError:
        ours = "unknown"
    return f"rlhfctl {ours} (trainer image {TRAINER_IMAGE}, vLLM {VLLM_VERSION})"


def exit_codes_help() -> str:
    """The exit-code convention of every subcommand (the --help epilog)."""
    from rlhf_contract.exit_codes import TABLE

    run_codes = ", ".join(f"{int(m.code)} {m.text}" for m in TABLE if m.code > ExitCode.CONFIG_ERROR)
    return (f"exit codes (every subcommand): {int(ExitCode.OK)} ok; {int(ExitCode.FAILED)} failed (a run or a "
            f"request failed, the cluster cannot be reached, a job or pod not found); {int(ExitCode.CONFIG_ERROR)} "
            "usage error or invalid job (a bad option, a job file, its data or --working-dir that cannot work, "
            "a plan that does not fit, a job the API server refuses). `run` and `submit --wait` end with the "
            f"run's own codes as they are: {run_codes}.")


def add_allow_host_path(p: argparse.ArgumentParser) -> None:
    """`--allow-host-path`: render as an operator installed with security.allowHostPath would."""
    p.add_argument("--allow-host-path", action="store_true",
                   help="accept hostPath volumes in spec.pod, as an operator installed with security.allowHostPath "
                        "does (default: refused, naming the volume)")


def build_parser() -> argparse.ArgumentParser:
    from .cluster_cli import add_cluster_commands
    from .output import add_output_arg
    from .support_cli import add_operator_commands, add_support_commands

    parser = argparse.ArgumentParser(prog="rlhfctl", description=__doc__, epilog=exit_codes_help())
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    def add_job_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("job", help="RLHFJob YAML file (-: read it from standard input)")
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

    from .validate import cmd_validate

    validate = sub.add_parser("validate", help="check a job file and report every problem")
    add_job_args(validate)
    add_output_arg(validate, "the result (valid, problems, warnings)")
    validate.set_defaults(func=cmd_validate)

    plan_cmd = sub.add_parser("plan", help="print the trainer's GPU memory plan of a job; exit 2 when it does not fit")
    add_job_args(plan_cmd)
    plan_cmd.add_argument("--gpu-memory-gib", type=float, help="memory of one trainer GPU (default: "
                          "trainer.gpuMemoryGiB, else this machine's GPU)")
    plan_cmd.add_argument("--gpus", type=int, help="trainer GPUs (default: trainer.numNodes x trainer.nprocPerNode)")
    plan_cmd.add_argument("--model-config", metavar="FILE",
                          help="the model's config.json, when model.path is neither on this machine nor an hf:// model "
                               "(read from the Hub: HF_ENDPOINT, HF_TOKEN)")
    add_output_arg(plan_cmd, "the plan (bytes)")
    plan_cmd.set_defaults(func=_cmd_plan)

    render = sub.add_parser("render", help="print the manifests the operator would create for a job (YAML)")
    add_job_args(render)
    render.add_argument("--backend", choices=["PyTorchJob", "JobSet", "TrainJob"], help="override spec.backend")
    render.add_argument("--namespace", help="the job's namespace (default: metadata.namespace or default)")
    render.add_argument("--uid", help=f"the job's metadata.uid, once the API server gave it (default {PLACEHOLDER_UID})")
    render.add_argument("--attempt", type=int, default=0, help="the attempt (status.restarts) to render")
    add_allow_host_path(render)
    add_output_arg(render, "the manifests (default YAML documents; json: a v1 List)")
    render.set_defaults(func=_cmd_render)
    add_cluster_commands(sub, add_job_args)

    export = sub.add_parser("export", help="write a checkpoint (checkpoints/step-N) as a Hugging Face model directory")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a complete <output>/checkpoints/step-N directory")
    export.add_argument("out", metavar="OUT", help="the model directory to write")
    export.add_argument("--model", help="the model the run started from (default: what <output>/job.json names)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    export.set_defaults(func=_cmd_export)

    plot = sub.add_parser("plot", help="draw the metrics of one or more runs (overlaid) into one PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="output directory of a run (holds metrics.jsonl)")
    plot.add_argument("--output", help="PNG to write (default: <first RUN_DIR>/plot.png)")
    plot.set_defaults(func=_cmd_plot)

    add_operator_commands(sub)

    crd = sub.add_parser("crd", help="print the RLHFJob CustomResourceDefinition")
    crd.set_defaults(func=_cmd_crd)
    add_support_commands(sub)
    for command in sub.choices.values():
        command.epilog = command.epilog or "exit codes: 0 ok, 1 failed, 2 usage error or invalid job (rlhfctl --help)"
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (rlhfctl completion bash|zsh)
        import argcomplete

        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
