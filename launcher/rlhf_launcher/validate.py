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
        check_hub_ids(job, source)
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


def check_hub_ids(job, source: str) -> None:
    """A JobError for each model or data path written as a bare Hub id (`Qwen/Qwen3-0.6B`)
    that is no path on this machine, saying the `hf://` address to write."""
    from rlhf_contract.api import JobError, Problem
    from rlhf_contract.api.uris import hub_id_hint

    s = job.spec
    paths = [("spec.model.path", s.model.path), ("spec.data.path", s.data.path)]
    if s.reward.model is not None:
        paths.append(("spec.reward.model.path", s.reward.model.path))
    paths += [(f"spec.evaluation.datasets[{i}].path", d.path)
              for i, d in enumerate(s.evaluation.datasets if s.evaluation is not None else [])]
    problems = [Problem(field, hint) for field, path in paths
                if not Path(path).exists() and (hint := hub_id_hint(path)) is not None]
    if problems:
        raise JobError(problems, source)


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


def hub_model_config(uri: str) -> dict:
    """The config.json of the `hf://` model `uri`, that file alone downloaded from the Hub
    (HF_ENDPOINT and HF_TOKEN from this environment) into a temporary directory; or a ValueError."""
    import json
    import os
    import tempfile

    from rlhf_contract.api.uris import parse_remote

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    remote = parse_remote(uri)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    server = endpoint or "the Hugging Face Hub"
    name = f"{remote.path}/config.json" if remote.path else "config.json"
    with tempfile.TemporaryDirectory(prefix="rlhfctl-config-") as tmp:
        try:
            local = hf_hub_download(remote.name, name, revision=remote.ref, endpoint=endpoint, local_dir=tmp,
                                    cache_dir=f"{tmp}/.hub-cache", token=os.environ.get("HF_TOKEN") or None)
            return json.loads(Path(local).read_text())
        except RevisionNotFoundError:
            why = f"no revision {remote.ref!r}"
        except EntryNotFoundError:
            why = f"no {name} in the repository"
        except RepositoryNotFoundError:
            why = f"no model repository {remote.name!r} (or it is private and HF_TOKEN cannot read it)"
        except HfHubHTTPError as err:
            why = f"{server} answered {err.response.status_code if err.response is not None else err}"
        except (OSError, ValueError) as err:
            why = f"{type(err).__name__}: {err}"
    raise ValueError(f"model.path: cannot read the config.json of {uri} from {server}: {why} (the plan reads only "
                     "that file; or give it with --model-config FILE)")


def model_config_here(path: str, *, hub: bool = False) -> dict:
    """The config.json of `model.path` (a built-in model's own config, built without its
    weights or model code; with `hub`, an `hf://` model's from the Hub), or a ValueError."""
    from .installed import quiet_transformers_without_torch

    quiet_transformers_without_torch()  # before transformers is imported
    from rlhf_trainer.preflight.memory_plan import read_model_config
    from rlhf_trainer.models.builtin import BUILTIN_MODELS, BUILTIN_PREFIX, tiny_qwen2_config

    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"model.path: unknown built-in model {path!r}")
        return tiny_qwen2_config(name).to_dict()
    if hub and path.startswith("hf://"):
        return hub_model_config(path)
    config = read_model_config(path)
    if config is None:
        raise ValueError(f"model.path: {path} has no readable config.json on this machine (the plan reads only "
                         "that file: give it with --model-config FILE)")
    return config
