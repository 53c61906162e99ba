"""Load the trained model and the frozen reference, lay them out over the trainer's
processes with the critic and the reward model (parallel/parallelize.py), and give the
causal LMs the chunked log-prob head (models/logprob_head.py). Shared by RL (rl/models.py)
and the offline methods.

The policy loads in fp32 (master weights; on CUDA FSDP2 computes in bf16); the
reference model never trains, so it has no optimizer state and, on GPUs, is stored in
bf16. The final export is written in the dtype the model's config declares
(`_rlhf_export_dtype`, checkpoint.save_final).

Sharded loading: whenever the models are laid out (several processes, or FSDP on one
GPU) the policy and the reference are built on the meta device (no memory, no random
init), parallelized there, given empty storage for their own shards only, and filled
from the checkpoint: rank 0 reads the safetensors files (in their stored dtype) and
streams them tensor by tensor; every rank keeps its shard (`set_model_state_dict` with
`broadcast_from_rank0`). So no GPU ever holds a whole model, and only rank 0's host reads
the files. One process on the CPU loads plainly. With `model.lora` the adapters are
injected before the layout (models/lora.py) and the reference is the policy with them off. The critic and score models are
read whole on the host and moved to the GPU a layer at a time by FSDP2 as it shards them
(`host_until_sharded`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_contract.trainer_config import ReferenceModel, TrainerConfig

from ..distributed import DistInfo
from ..parallel.parallelize import Layout, parallelize_models
from .logprob_head import attach_logprob_head
from .lora import AdaptersOff, add_adapters, file_key, init_adapters, initial_adapters


def host_until_sharded(device: torch.device) -> torch.device:
    """Where to build a model read whole (the critic, a score model): on GPUs the host, as
    FSDP2's `fully_shard` moves each decoder layer to the GPU as it shards it, so no GPU
    ever holds the whole model; elsewhere `device` itself."""
    return torch.device("cpu") if device.type == "cuda" else device


def stored_dtype(path: str) -> torch.dtype:
    """The dtype `path`'s config declares (what the final export is written in)."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def load_causal_lm(path: str, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model._rlhf_export_dtype = stored_dtype(path)
    return model


def empty_causal_lm(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model of `path`'s config with parameters of `dtype` on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    export = stored_dtype(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model._rlhf_export_dtype = export
    return model


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory (one `model.safetensors` or the shards
    named by `model.safetensors.index.json`), in its stored dtype."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"model.path: no model.safetensors or model.safetensors.index.json in {path}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(path / name)))
    return out


def _rebuild_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies) are not in checkpoints: compute them
    again for the modules that own them (after `to_empty` they hold garbage)."""
    for name, module in model.named_modules():
        if not getattr(module, "_non_persistent_buffers_set", None):
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise ValueError(f"model.path: cannot rebuild the non-persistent buffers of {name} "
                             f"({type(module).__name__}) after sharded loading")
        with torch.device(device):
            fresh = type(module)(config=module.config)
        for key in module._non_persistent_buffers_set:
            module._buffers[key] = fresh._buffers[key]


def fill_from_checkpoint(model: torch.nn.Module, path: str, device: torch.device, seed: int = 0) -> None:
    """Collective: give a parallelized meta-device model storage for its shards and load
    `path`'s weights into them (rank 0 reads and broadcasts; each rank keeps its shard).
    LoRA adapters (models/lora.py) start from their seeded initial values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    _rebuild_buffers(model, device)
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        stored = read_safetensors(path)
        if "lm_head.weight" not in stored and getattr(model.config, "tie_word_embeddings", False):
            stored["lm_head.weight"] = stored["model.embed_tokens.weight"]  # tied output embedding: stored once
        adapters = initial_adapters(model, seed)  # empty without LoRA
        missing = []
        for key in model.state_dict():
            source = file_key(key)
            if source is None:
                full[key] = adapters[key]
            elif source in stored:
                full[key] = stored[source]
            else:
                missing.append(source)
        if missing:
            raise ValueError(f"model.path: {path} lacks {len(missing)} weights the model needs, e.g. {missing[:3]}")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))


def load_models(config: TrainerConfig, info: DistInfo, *, trained: torch.nn.Module | None = None,
                reference: ReferenceModel | None = None, critic: torch.nn.Module | None = None,
                reward_model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, torch.nn.Module | None, Layout]:
    """Build the trained model (the causal LM of `model.path`, or `trained` when given,
    e.g. a score model), the frozen reference (`reference`, TrainerConfig.reference_model:
    the starting model, or a distillation teacher), lay them out with the optional critic and the
    reward model, and fill the sharded ones from their checkpoints; causal LMs get the
    chunked log-prob head. Returns (trained, reference, layout). The layout of FSDP2 (the
    default engine); DeepSpeed's is engine/zero.py `load_for_zero`."""
    sharded = info.world_size > 1 or info.device.type == "cuda"
    new = empty_causal_lm if sharded else (lambda path, dtype: load_causal_lm(path, info.device, dtype))
    lm = trained is None
    model = new(config.model_path, torch.float32) if lm else trained
    seed = config.schedule.seed
    if config.lora is not None:
        add_adapters(model, config.lora)
        if not (sharded and lm):  # else filled with the checkpoint
            init_adapters(model, seed)
    # the reference never trains: on GPUs it is stored in bf16 (what it computes in), no optimizer state;
    # with adapters it is the base itself (the policy with its adapters off): no second copy
    ref_dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32
    separate_ref = reference is not None and reference.copy
    ref_path = reference.path if reference is not None else config.model_path
    ref = new(ref_path, ref_dtype).eval().requires_grad_(False) if separate_ref else None
    p = config.optim.parallelism
    # decided once before any model loads (main.py: preflight.with_checkpointing_decided); unset here = off
    checkpointing = bool(p.activation_checkpointing)
    layout = parallelize_models(model, ref=ref, critic=critic, world_size=info.world_size, tp=p.tensor_parallel,
                                cp=p.context_parallel, activation_checkpointing=checkpointing,
                                device_type=info.device.type, reward_model=reward_model)
    for m, path in (((model, config.model_path), (ref, ref_path)) if lm else ((ref, ref_path),)):
        if m is not None:
            if sharded:
                fill_from_checkpoint(m, path, info.device, seed)
            attach_logprob_head(m)
    if reference is not None and not separate_ref:
        ref = AdaptersOff(model)
    return model, ref, layout
