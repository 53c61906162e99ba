"""What `rlhfctl validate` checks on this machine beyond the contract: the job file (the
contract's loader: aliases, duplicate keys, size, paths, URL credentials), the datasets that are
here (the trainer's data checks), and the token budgets against the context length of the
models whose config is readable here (a local directory with config.json, a built-in model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf_contract.exit_codes import ExitCode


def check_data_here(job):
    """The trainer's data checks (rlhf_trainer/preflight/data.py) on the datasets that are on
    this machine, measured with the model's tokenizer when it is here too (a built-in model
    tokenizer is written to a temporary directory, without its weights) and transformers is installed."""
    import tempfile

    from .installed import quiet_transformers_without_torch

    quiet_transformers_without_torch()  # before transformers is imported
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


def cmd_validate(args: argparse.Namespace) -> int:
    from rlhf_contract.api import JobError, job_source, load_job

    from .output import emit

    source = job_source(args.job)
    try:
        job = load_job(args.job, args.set)
        budget_warnings = check_budgets_here(job, source)
    except JobError as err:
        if args.output_format:
            emit({"valid": False, "source": source, "problems": [vars(p) for p in err.problems]}, args.output_format)
        print(err, file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    report = check_data_here(job)
    report.warnings[:0] = budget_warnings
    if args.output_format:
        emit({"valid": not report.problems, "source": source, "name": job.metadata.name,
              "problems": [{"path": None, "message": p} for p in report.problems], "warnings": list(report.warnings),
              "notes": list(report.unchecked)}, args.output_format)
    for line in report.unchecked:
        print(f"note: {line}", file=sys.stderr)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if report.problems:
        print(f"{source}: the data cannot work as configured:\n" + "\n".join(f"  {p}" for p in report.problems),
              file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    if not args.output_format:
        prefix = (job.metadata.model_extra or {}).get("generateName")
        named = f"{job.metadata.name!r}" if not prefix else f"(generateName {prefix!r}: the server names it, e.g. " \
            f"{job.metadata.name!r})"
        print(f"{source}: valid RLHFJob {named}")
    return ExitCode.OK


def check_budgets_here(job, source: str) -> list[str]:
    """The token budgets against the context of each model whose config is here
    (rlhf_contract/api/budgets.py): warnings, or a JobError naming the field."""
    from rlhf_contract.api import JobError, Problem
    from rlhf_contract.api.budgets import budget_problems, context_length

    def context_of(path: str) -> int | None:
        try:
            return context_length(model_config_here(path))
        except (ValueError, ImportError, OSError):
            return None  # not on this machine: the trainer's preflight checks it in the pod

    problems, warnings = budget_problems(job.spec, context_of, count_tokens_here)
    if problems:
        raise JobError([Problem(path, message) for path, message in problems], source)
    return warnings


def count_tokens_here(path: str, text: str) -> int | None:
    """Tokens of `text` by the tokenizer of the model at `path` (a local directory or a
    built-in model), or None when it cannot be loaded here."""
    import tempfile

    from .installed import quiet_transformers_without_torch

    quiet_transformers_without_torch()
    try:
        from rlhf_trainer.models.builtin import BUILTIN_PREFIX, materialize_tokenizer
        from rlhf_trainer.preflight.data import load_tokenizer

        with tempfile.TemporaryDirectory(prefix="rlhfctl-validate-") as tmp:
            where = str(materialize_tokenizer(path, tmp)) if path.startswith(BUILTIN_PREFIX) else path
            if not Path(where).is_dir():
                return None
            return len(load_tokenizer(where)(text, add_special_tokens=False)["input_ids"])
    except (ImportError, ValueError, OSError):
        return None


def model_config_here(path: str) -> dict:
    """The config.json of `model.path` (a built-in model's own config, built without its
    weights or model code), or a ValueError."""
    from .installed import quiet_transformers_without_torch

    quiet_transformers_without_torch()  # before transformers is imported
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
