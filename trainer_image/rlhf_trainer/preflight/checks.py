"""Every error a user can fix, found before any model loads.

`check(config, world_size)` reads only small files (the model's config.json, the
environment file; it imports the reward functions and matches their parameters to a form,
rewards.py), and of the data only the columns and a bounded sample, measured
with the model's tokenizer (data.py: no rows, missing columns, prompts longer than
data.maxPromptLength, ...), and returns one message per problem, each naming the spec
field and what to change; the data's warnings go to stderr. The launcher
(`python -m rlhf_trainer.launch`) runs it first thing in a trainer pod and in local mode,
and exits with code 2 (`ExitCode.CONFIG_ERROR`, the operator's "bad config: fail at once")
instead of starting torchrun, so such a job fails in seconds rather than after every
allowed restart. When a GPU's memory is known (`trainer.gpuMemoryGiB`, else `nvidia-smi`)
it also refuses a job whose memory plan (memory_plan.py) does not fit, naming the fields
to change, and NCCL network settings that can never form a group (network.py). It exits
nothing itself and loads no model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rlhf_contract.api.uris import hub_id_hint
from rlhf_contract.trainer_config import TrainerConfig

from ..data.examples import BUILTIN_OFFLINE
from .data import check_data, load_tokenizer
from .network import network_problems
from .rewards import reward_problems
from .memory_plan import detect_gpu_bytes, gib, read_model_config


def _model_config(path: str) -> tuple[dict | None, str | None]:
    if path.startswith("builtin://"):
        return None, (f"spec.model.path: {path} is a built-in model, which only local mode (rlhfctl run) provides; "
                      "give a Hugging Face model directory on a mounted volume")
    config = Path(path) / "config.json"
    if not Path(path).is_dir():
        missing = hub_id_hint(path) or f"{path} does not exist in the trainer (mount the volume that holds the model)"
        return None, f"spec.model.path: {missing}"
    try:
        return json.loads(config.read_text()), None
    except OSError:
        return None, f"spec.model.path: {path} has no readable config.json: not a Hugging Face model directory"
    except json.JSONDecodeError as err:
        return None, f"spec.model.path: {config} is not valid JSON ({err})"


def _readable_python(path: str | None, field: str) -> str | None:
    if not path:
        return None
    try:
        source = Path(path).read_text()
    except OSError as err:
        return f"{field}: cannot read {path} ({err.strerror or err}); mount it into the trainer or fix the path"
    try:
        compile(source, path, "exec")
    except SyntaxError as err:
        return f"{field}: {path} line {err.lineno}: {err.msg}"
    return None


def _tool_problems(config: TrainerConfig) -> list[str]:
    """`rollout.tools`: each file readable Python, each function there, each schema made, each
    MCP server started and its tools listed."""
    from ..rollout.tools import ToolConfigError, load_tools

    unreadable = [problem for i, f in enumerate(config.tools.functions)
                  if (problem := _readable_python(f.file, f"spec.rollout.tools.functions[{i}].file"))]
    if unreadable:
        return unreadable
    try:
        load_tools(config.tools)
    except ToolConfigError as err:
        return [f"spec.{err}"]
    return []


def _agent_problems(config: TrainerConfig) -> list[str]:
    """`rollout.agent`: its program found (on PATH, or as a path), and a Python script it runs readable."""
    import shutil

    from ..rollout.tool_types import program_command

    command = program_command(config.agent.command)
    if shutil.which(command[0]) is None:
        return [f"spec.rollout.agent.command[0]: {command[0]} is not a program on PATH nor an executable file; "
                "give the agent's program (e.g. [python, agent.py]) as the trainer sees it"]
    script = command[1] if len(command) > 1 and command[1].endswith(".py") else None
    problem = _readable_python(script, "spec.rollout.agent.command[1]") if script else None
    return [problem] if problem else []


def _data_problems(config: TrainerConfig, model_ok: bool) -> list[str]:

    report = check_data(config, (lambda: load_tokenizer(config.model_path)) if model_ok else (lambda: None))
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return report.problems


def teacher_problems(config: TrainerConfig, model_ok: bool) -> list[str]:
    """`method: distill`: the teacher is a causal LM directory whose tokenizer is the
    student's (same vocabulary, ids and special tokens), since it scores the student's
    token ids as they are."""
    field, path = "spec.distillation.teacher.path", config.distillation.teacher.path
    if path.startswith("builtin://"):
        return [f"{field}: {path} is a built-in (untrained) model; give a trained model's directory, e.g. the "
                "final/ of an rl run"]
    teacher, error = _model_config(path)
    if error:
        return [error.replace("spec.model.path", field)]
    if not any(str(a).endswith("ForCausalLM") for a in teacher.get("architectures") or []):
        return [f"{field}: {path} is not a causal language model (architectures {teacher.get('architectures')})"]
    if not model_ok:
        return []
    try:
        student_tok, teacher_tok = load_tokenizer(config.model_path), load_tokenizer(path)
    except ValueError as err:
        return [str(err).replace("spec.model.path", field) if path in str(err) else str(err)]
    differ = [what for what, get in (("vocabulary", lambda t: t.get_vocab()),
                                     ("special tokens", lambda t: t.special_tokens_map),
                                     ("eos token id", lambda t: t.eos_token_id))
              if get(student_tok) != get(teacher_tok)]
    if differ:
        return [f"{field}: the teacher's tokenizer differs from the student's (spec.model.path) in its "
                f"{', '.join(differ)}: it would score other tokens than the student sampled; distill from a teacher "
                "with the student's tokenizer"]
    return []


def tracking_problems(config: TrainerConfig) -> list[str]:
    """What keeps `spec.tracking`'s trackers from starting, found before any model loads."""
    wandb, problems = config.tracking.wandb, []
    if wandb is not None and wandb.mode == "online" and not os.environ.get("WANDB_API_KEY"):
        import netrc

        host = (wandb.base_url or "https://api.wandb.ai").split("://", 1)[1].split("/")[0]
        try:
            known = netrc.netrc().authenticators(host) is not None
        except (OSError, netrc.NetrcParseError):
            known = False
        if not known:
            problems.append("spec.tracking.wandb.apiKeySecret: Weights & Biases online needs an API key and none "
                            "is set (WANDB_API_KEY); name the Secret key that holds it in tracking.wandb.apiKeySecret "
                            "(locally: export WANDB_API_KEY), or set tracking.wandb.mode: offline")
    for module, field in (("wandb", "wandb"), ("mlflow", "mlflow")):
        import importlib.util

        if getattr(config.tracking, field) is not None and importlib.util.find_spec(module) is None:
            problems.append(f"spec.tracking.{field}: the {module} package is not installed in the trainer image")
    return problems


def output_problems(config: TrainerConfig) -> list[str]:
    """`output.hub` pushes at the end of the run: its token must be there before it starts
    (`output.uri`'s key is proven writable by the download step)."""
    if config.output.hub is None or os.environ.get("HF_TOKEN"):
        return []
    from ..storage import credentials_source

    return [f"spec.output.hub.repo: pushing to {config.output.hub.repo!r} needs a Hub token and none is set: "
            f"{credentials_source('HF_TOKEN')}"]


def gpu_memory_bytes(config: TrainerConfig) -> int | None:
    """One trainer GPU's memory: `trainer.gpuMemoryGiB`, else `nvidia-smi`'s, else None
    (no GPU: local CPU mode)."""
    return gib(config.optim.gpu_memory_gib) if config.optim.gpu_memory_gib else detect_gpu_bytes()


def memory_problems(config: TrainerConfig, world_size: int, model: dict | None) -> list[str]:
    """The memory plan's problem (memory_plan.py) when the job cannot fit in one GPU's memory;
    nothing without a GPU to plan for or a model config to plan from."""
    gpu = gpu_memory_bytes(config) if model is not None else None
    if gpu is None:
        return []
    from .memory_colocated import memory_verdict

    rm = read_model_config(config.reward.model.path) if config.reward.model is not None else None
    try:
        verdict = memory_verdict(config, model, world_size, gpu, reward_model_config=rm)
    except Exception as err:  # a model family the plan cannot build: say so, do not refuse the job
        print(f"warning: no memory plan for {config.model_path} ({type(err).__name__}: {err})", file=sys.stderr,
              flush=True)
        return []
    return [verdict.problem] if verdict.problem else []


def check(config: TrainerConfig, world_size: int) -> list[str]:
    """The problems of `config` for a trainer world of `world_size` processes."""
    problems = []
    p = config.optim.parallelism
    model, error = _model_config(config.model_path)
    if error:
        problems.append(error)
    data = config.data.path
    problems += _data_problems(config, model_ok=error is None)
    problems += tracking_problems(config) + output_problems(config)
    problems += network_problems()  # NCCL's interface and transport in this pod (network.py)
    problems += memory_problems(config, world_size, model)
    problems += config.rule_problems(world_size)  # the contract's cross-field rules, on the real world size
    if config.method.offline:
        if data.startswith("builtin://"):
            kind = "pair" if config.method.pairs else "sft"
            choices = [f"builtin://{n}" for n, (k, _) in BUILTIN_OFFLINE.items() if k == kind]
            if data not in choices:
                problems.append(f"spec.data.path: {data} is not a built-in {config.method} task; choose one of "
                                + ", ".join(choices))
        return problems  # the rest is about rollouts and rewards
    if model is not None and p.tensor_parallel > 1:
        heads = model.get("num_attention_heads")
        kv = model.get("num_key_value_heads") or heads
        if heads and (heads % p.tensor_parallel or kv % p.tensor_parallel):
            problems.append(f"spec.trainer.parallelism.tensorParallel: {p.tensor_parallel} must divide the model's "
                            f"attention heads ({heads}) and key/value heads ({kv})")
    if config.reward.model is not None:
        rm, error = _model_config(config.reward.model.path)
        if error:
            problems.append(error.replace("spec.model.path", "spec.reward.model.path"))
        elif rm is not None and not any(str(a).endswith("ForSequenceClassification") for a in rm.get("architectures") or []):
            problems.append(f"spec.reward.model.path: {config.reward.model.path} is not a sequence classifier "
                            f"(architectures {rm.get('architectures')}); train one with method: rm")
        elif rm is not None and len(rm.get("id2label") or {0: ""}) != 1:
            problems.append(f"spec.reward.model.path: {config.reward.model.path} is a classifier with "
                            f"{len(rm['id2label'])} labels; a reward model has 1 (what method: rm exports)")
    if config.distillation is not None:
        problems += teacher_problems(config, model_ok=model is not None)
    problems += reward_problems(config)
    if config.environment is not None and config.environment.file is not None:
        problems += filter(None, [_readable_python(config.environment.file, "spec.environment.file")])
    if config.tools is not None:
        problems += _tool_problems(config)
    if config.agent is not None:
        problems += _agent_problems(config)
    if config.environment is not None and config.environment.gem is not None:
        import importlib.util

        if importlib.util.find_spec("gem") is None:
            problems.append("spec.environment.gem: the gem-llm package is not installed in the trainer image "
                            "(pip install 'rlhf-operator[gem]')")
    return problems
