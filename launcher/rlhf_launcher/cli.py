"""`rlhfctl`: run a job locally, validate a job file, plan its GPU memory, render the
manifests the operator would create for it, export a checkpoint as a model, plot runs'
metrics, print the CRD."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlhf_contract.exit_codes import ExitCode


def _check_data(job):
    """The trainer's data checks (rlhf_trainer/preflight/data.py) on the datasets that are on
    this machine, measured with the model's tokenizer when it is here too (a built-in model
    tokenizer is written to a temporary directory, without its weights) and transformers is installed."""
    import tempfile

    from rlhf_contract.trainer_config import TrainerConfig
    from rlhf_trainer.preflight.data import check_data, load_tokenizer

    with tempfile.TemporaryDirectory(prefix="rlhfctl-validate-") as tmp:
        def tokenizer():
            path = job.spec.model.path
            try:
                if path.startswith("builtin://"):
                    from rlhf_trainer.models.builtin import materialize_tokenizer

                    path = str(materialize_tokenizer(path, tmp))
                return load_tokenizer(path) if Path(path).is_dir() else None
            except ImportError:
                return None

        return check_data(TrainerConfig.from_job(job), tokenizer, require_paths=False)


def _cmd_validate(args: argparse.Namespace) -> int:
    from rlhf_contract.api import JobError, load_job

    try:
        job = load_job(args.job, args.set)
    except JobError as err:
        print(err, file=sys.stderr)
        return 1
    report = _check_data(job)
    for line in report.unchecked:
        print(f"note: {line}", file=sys.stderr)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if report.problems:
        print(f"{args.job}: the data cannot work as configured:\n" + "\n".join(f"  {p}" for p in report.problems),
              file=sys.stderr)
        return 1
    print(f"{args.job}: valid RLHFJob {job.metadata.name!r}")
    return 0


def _plan_model_config(path: str) -> dict:
    """The config.json of `model.path` (a built-in model's own config, built without its
    weights or model code), or a ValueError."""
    from rlhf_trainer.preflight.memory_plan import read_model_config
    from rlhf_trainer.models.builtin import BUILTIN_MODELS, BUILTIN_PREFIX, tiny_qwen2_config

    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"model.path: unknown built-in model {path!r}")
        return tiny_qwen2_config(name).to_dict()
    config = read_model_config(path)
    if config is None:
        raise ValueError(f"model.path: {path} has no readable config.json on this machine (the plan reads only "
                         "that file: give it with --model-config FILE)")
    return config


def _cmd_plan(args: argparse.Namespace) -> int:
    """The trainer's GPU memory plan (rlhf_trainer/preflight/memory_plan.py) for a job: a table, and
    exit 2 with the preflight's message when it does not fit."""
    from rich.console import Console
    from rich.table import Table

    from rlhf_contract.api import JobError, load_job
    from rlhf_contract.trainer_config import TrainerConfig
    from rlhf_trainer.preflight.memory_plan import GIB, detect_gpu_bytes, gib, plan

    try:
        job = load_job(args.job, args.set)
    except JobError as err:
        print(err, file=sys.stderr)
        return 1
    config = TrainerConfig.from_job(job)
    t = job.spec.trainer
    world = args.gpus or t.num_nodes * t.nproc_per_node
    size = args.gpu_memory_gib or config.optim.gpu_memory_gib
    gpu = gib(size) if size else detect_gpu_bytes()
    if gpu is None:
        print("error: no GPU here to read its memory from: give --gpu-memory-gib N (or set trainer.gpuMemoryGiB)",
              file=sys.stderr)
        return 1
    try:
        model = (json.loads(Path(args.model_config).read_text()) if args.model_config
                 else _plan_model_config(config.model_path))
        rm = _plan_model_config(config.reward.model.path) if config.reward.model is not None else None
        result = plan(config, model, world, gpu, reward_model_config=rm)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    p = config.optim.parallelism
    table = Table(title=f"{job.metadata.name}: memory per GPU, {world} trainer GPUs of {gpu / GIB:.1f} GiB "
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
    if not result.fits:
        print(result.message(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    console.print(f"fits: {result.total / GIB:.1f} of {gpu / GIB:.1f} GiB per GPU")
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
        return 1
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
    YAML documents: for review before `kubectl apply` (GitOps). The job's uid is only known
    once the API server has it: `--uid` (owner references, pod labels) or a placeholder."""
    import yaml

    from rlhf_contract.api import JobError, load_job
    from rlhf_operator.builders import build_support, build_workloads
    from rlhf_operator.builders.pods import PodSettings, PodSettingsError

    try:
        job = load_job(args.job, [*args.set, *([f"backend={args.backend}"] if args.backend else [])])
    except JobError as err:
        print(err, file=sys.stderr)
        return 1
    extra = dict(job.metadata.model_extra or {})
    extra["uid"] = args.uid or extra.get("uid") or PLACEHOLDER_UID
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={
        "namespace": args.namespace or job.metadata.namespace or "default"})})
    job.metadata.__pydantic_extra__.update(extra)
    try:
        settings = PodSettings.from_job(job)
    except PodSettingsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    objects = [*build_support(job), *build_workloads(job, args.attempt, settings)]
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


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


def _add_cluster_commands(sub) -> None:
    """`rlhfctl operator` and `rlhfctl smoke-test` (the chart's `helm test`)."""
    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf) against the current kubeconfig")
    op.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable; default: all)")
    op.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (0: off)")
    op.add_argument("--lease-namespace", help="namespace of the leader Lease (default: $POD_NAMESPACE or the first --namespace)")
    op.add_argument("--lease-name", default="rlhf-operator",
                    help="name of the leader Lease (the chart gives each release its own)")
    op.add_argument("--lease-duration", type=int, default=15, help="seconds before another replica may take over")
    op.add_argument("--resync-seconds", type=float, default=15.0, help="reconcile every job at least this often")
    op.add_argument("--verbose", action="store_true")
    op.add_argument("--health-port", type=int, default=0,
                    help="serve /healthz (liveness: fails when the operator stops making progress) and /readyz (0: off)")
    op.add_argument("--log-format", choices=["text", "json"], default="text",
                    help="json: one object per line (time, level, logger, message)")

    def _cmd_operator(a: argparse.Namespace) -> int:
        from rlhf_operator.handlers import run as run_operator

        return run_operator(a.namespace, metrics_port=a.metrics_port, lease_namespace=a.lease_namespace,
                            lease_name=a.lease_name, lease_duration=a.lease_duration, resync_seconds=a.resync_seconds, verbose=a.verbose,
                            log_format=a.log_format, health_port=a.health_port)

    op.set_defaults(func=_cmd_operator)

    smoke = sub.add_parser("smoke-test", help="create a tiny suspended job, wait for its children, delete it "
                                              "(the chart's `helm test`)")
    smoke.add_argument("--namespace", required=True)
    smoke.add_argument("--name", default="rlhf-smoke-test")
    smoke.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the children")

    def _cmd_smoke(a: argparse.Namespace) -> int:
        from rlhf_operator.kube import Kube
        from rlhf_operator.smoke import run_smoke_test

        return run_smoke_test(Kube(), a.namespace, a.name, a.timeout)

    smoke.set_defaults(func=_cmd_smoke)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhfctl", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
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

    plan_cmd = sub.add_parser("plan", help="print the trainer's GPU memory plan of a job; exit 2 when it does not fit")
    add_job_args(plan_cmd)
    plan_cmd.add_argument("--gpu-memory-gib", type=float, help="memory of one trainer GPU (default: "
                          "trainer.gpuMemoryGiB, else this machine's GPU)")
    plan_cmd.add_argument("--gpus", type=int, help="trainer GPUs (default: trainer.numNodes x trainer.nprocPerNode)")
    plan_cmd.add_argument("--model-config", metavar="FILE",
                          help="the model's config.json, when model.path is not on this machine")
    plan_cmd.set_defaults(func=_cmd_plan)

    render = sub.add_parser("render", help="print the manifests the operator would create for a job (YAML)")
    add_job_args(render)
    render.add_argument("--backend", choices=["PyTorchJob", "JobSet"], help="override spec.backend")
    render.add_argument("--namespace", help="the job's namespace (default: metadata.namespace or default)")
    render.add_argument("--uid", help=f"the job's metadata.uid, once the API server gave it (default {PLACEHOLDER_UID})")
    render.add_argument("--attempt", type=int, default=0, help="the attempt (status.restarts) to render")
    render.set_defaults(func=_cmd_render)

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

    _add_cluster_commands(sub)

    crd = sub.add_parser("crd", help="print the RLHFJob CustomResourceDefinition")
    crd.set_defaults(func=_cmd_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
