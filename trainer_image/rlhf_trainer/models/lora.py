"""LoRA (`model.lora`): low-rank adapters, injected by peft into the model itself
(`inject_adapter_in_model`: the model keeps its class, its `lm_head`, its decoder layers),
trained on a frozen base, with the modules of `model.lora.modulesToSave` trained whole.

- Only the adapters, the `modulesToSave` copies (and a score model's `score` head) require
  gradients, so the optimizer, gradients and checkpoints (trainable state only) hold those.
- The reference model is the base itself: `AdaptersOff(policy)` runs the policy with every
  adapter off and every `modulesToSave` module back to its original; no second model.
- Adapters start as peft starts them (A: Kaiming-uniform, B: 0, so the first policy is the
  base), drawn from `schedule.seed` in one fixed order, so one process and a sharded run
  start from the same adapters. A `modulesToSave` copy starts as the base's weight (the
  same file key).
- Weight sync and the final export see the merged model (`merged_tensors`): Hugging Face
  names, W + (alpha / r) B A computed tensor by tensor as they are gathered, a trained
  copy under its module's own name; nothing in the model is merged in place. The rollout
  servers therefore need no LoRA support and receive exactly the weights the trainer
  computes with.
- `save_adapter` writes the adapters (and trained copies) in peft's own format as well.

Why the output head trains whole (peft's `modules_to_save`) and takes no adapter: the
log-prob head (models/logprob_head.py) multiplies by the head's `weight` directly, and
peft's wrapper answers `weight` with the trained copy (the original when adapters are off),
so the log-prob head, the reference and FSDP need no change; an adapter on the head would
need a second, low-rank product in every chunk of the log-prob head. Not supported: a
`modulesToSave` module tied to the input embedding (`tie_word_embeddings`): training it
would train both, so it is refused.

Names: peft renames a wrapped layer's weight `x.weight` -> `x.base_layer.weight` and adds
`x.lora_A.default.weight` [r, in] and `x.lora_B.default.weight` [out, r]; a module to save
`m` holds `m.original_module.*` (frozen) and `m.modules_to_save.default.*` (trained).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

ADAPTER = "default"
"""peft's name for the one adapter."""
TRAINED_HEADS = ("score",)
"""Heads that train whole beside the adapters (a score model's new head) and get none."""
_BASE, _A, _B = ".base_layer.", f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."
_ORIGINAL, _SAVED = ".original_module.", f".modules_to_save.{ADAPTER}."
"""A module to save: its frozen original and its trained copy."""


def lora_config(spec, *, exclude: Iterable[str] = ()):
    """peft's `LoraConfig` of a `model.lora` spec."""
    from peft import LoraConfig

    targets = spec.target_modules
    target = targets[0] if targets == ["all-linear"] else list(targets)
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=target,
                      exclude_modules=list(exclude) or None, modules_to_save=list(spec.modules_to_save) or None,
                      bias="none")


def _is_trained(name: str, heads: Iterable[str] = ()) -> bool:
    return _A in name or _B in name or _SAVED in name or name.split(".")[0] in heads


def _check_modules_to_save(model: torch.nn.Module, names: list[str]) -> None:
    """ValueError naming `model.lora.modulesToSave` for a name that matches no module (by
    name suffix, as peft matches: `norm` also matches `input_layernorm`) or a module that
    holds an embedding tied to the other one."""
    shared = set()
    if names and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        shared = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    for target in names:
        matched = [m for n, m in model.named_modules() if n.endswith(target)]
        if not matched:
            raise ValueError(f"model.lora.modulesToSave: {target!r} matched no module of the model; "
                             "name a module such as lm_head")
        if any(id(p) in shared for m in matched for p in m.parameters()):
            raise ValueError(f"model.lora.modulesToSave: {target!r} holds an embedding tied to the other one (the "
                             "model's tie_word_embeddings is true), so training it would train both; leave it out")


def add_adapters(model: torch.nn.Module, spec) -> torch.nn.Module:
    """Inject adapters into `model` in place (any device, meta included), wrap its
    `modulesToSave`; freeze the rest but a score head. Raises ValueError naming the
    `model.lora` field at fault."""
    from peft import inject_adapter_in_model

    heads = [name for name in TRAINED_HEADS if isinstance(getattr(model, name, None), torch.nn.Linear)]
    _check_modules_to_save(model, list(spec.modules_to_save))
    try:
        inject_adapter_in_model(lora_config(spec, exclude=heads), model)
    except TypeError as err:  # peft: a module to save inside one that has an adapter
        raise ValueError(f"model.lora.modulesToSave: {spec.modules_to_save} names a part of a layer that "
                         f"model.lora.targetModules gives an adapter ({err}); name whole modules") from None
    except ValueError as err:
        raise ValueError(f"model.lora.targetModules: {spec.target_modules} matched no layer of the model ({err}); "
                         "name linear layers such as q_proj, v_proj, or use all-linear (modules named in "
                         "model.lora.modulesToSave get none)") from None
    _check_wrapped(model)
    for name, p in model.named_parameters():
        p.requires_grad_(_is_trained(name, heads))
    return model


def _check_wrapped(model: torch.nn.Module) -> None:
    """ValueError naming `model.lora.targetModules` for an adapter on the output head or on
    a layer that is not linear."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and isinstance(head, BaseTunerLayer):
        raise ValueError("model.lora.targetModules: the output head (lm_head) cannot have an adapter (the trainer "
                         "computes log-probs from its weight directly); leave it out (all-linear does) and name it "
                         "in model.lora.modulesToSave to train it whole")
    odd = {name: type(m).__name__ for name, m in model.named_modules()
           if isinstance(m, BaseTunerLayer) and not isinstance(m, LoraLinear)}
    if odd:
        raise ValueError(f"model.lora.targetModules: {sorted(odd)[:3]} are not linear layers ({sorted(set(odd.values()))}); "
                         "only linear layers get adapters")


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """Each wrapped layer's name -> alpha / r (what B A is multiplied by)."""
    from peft.tuners.lora import LoraLayer

    return {name: float(m.scaling[ADAPTER]) for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def initial_adapters(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter's starting value (CPU, fp32) by parameter name: A Kaiming-uniform as
    peft draws it, B zero; from `seed`, in parameter order, whatever the layout. (A
    `modulesToSave` copy is not an adapter: it starts from the base's file, `file_key`.)"""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if _A in name:
            out[name] = torch.nn.init.kaiming_uniform_(torch.empty(tuple(p.shape)), a=math.sqrt(5), generator=gen)
        elif _B in name:
            out[name] = torch.zeros(tuple(p.shape))
    return out


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """Set an unsharded model's adapters to `initial_adapters`."""
    values = initial_adapters(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in values:
                p.copy_(values[name])


def file_key(name: str) -> str | None:
    """The key of a model state entry in the base model's files (None: an adapter). A
    module to save's original and trained copy both start from the module's own key."""
    if _A in name or _B in name:
        return None
    return name.replace(_BASE, ".").replace(_ORIGINAL, ".").replace(_SAVED, ".")


def _switchable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The adapter layers and the modules-to-save wrappers of `model`."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run `model` as its base: every adapter layer off and every module to save back to
    its original (peft's flag, read by its forward and by the wrapper's attribute lookup;
    set directly so that no parameter's requires_grad changes under FSDP)."""
    layers = _switchable(model)
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


class AdaptersOff:
    """The reference model of a LoRA run: the policy with its adapters off. Calls run the
    policy's forward (its log-prob head, its sharding) as the base; attributes are the
    policy's."""

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self._model):
            return self._model(*args, **kwargs)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective for FSDP's DTensors)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def merged_tensors(model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]], *,
                   full: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   shape: Callable[[torch.Tensor], list[int]] | None = None,
                   ) -> tuple[list[tuple[str, list[int], torch.dtype]], Iterator[torch.Tensor]]:
    """(name, shape, dtype) of every entry of `items` (`named_parameters()` or
    `state_dict().items()`) as the merged model names it, and a generator of the full
    tensors in that order: W + scaling x B A for wrapped weights, computed in fp32 and
    returned in W's dtype; a module to save's trained copy under the module's name, its
    original left out. `full` gathers one whole tensor and `shape` gives its global shape
    (an engine's, e.g. ZeRO-3's; default: DTensors and plain tensors). Collective for
    sharded tensors: every rank must run the generator to its end. Without adapters: the
    entries as they are."""
    full, shape = full or _full, shape or (lambda t: list(t.shape))
    items = list(items)
    lookup = dict(items)
    scale = scalings(model)
    specs, plan = [], []
    for name, tensor in items:
        if _A in name or _B in name or _ORIGINAL in name:
            continue
        merged = None
        if _BASE in name:
            layer, leaf = name.split(_BASE, 1)
            if leaf == "weight":
                merged = (lookup[f"{layer}{_A}weight"], lookup[f"{layer}{_B}weight"], scale[layer])
        specs.append((file_key(name), shape(tensor), tensor.dtype))
        plan.append((tensor, merged))

    def tensors() -> Iterator[torch.Tensor]:
        for tensor, merged in plan:
            whole = full(tensor)
            if merged is not None:
                a, b, s = merged
                whole = (whole.float() + (full(b).float() @ full(a).float()) * s).to(whole.dtype)
            yield whole

    return specs, tensors()


def adapter_file_key(name: str) -> str | None:
    """The key peft's `adapter_model.safetensors` holds a trained parameter under (None:
    not in the adapter file): the PeftModel's prefix, no adapter name; a module to save's
    trained copy under the module's own name (`lm_head.weight`), as peft writes it."""
    if _A in name or _B in name:
        return f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}"
    if _SAVED in name:
        return f"base_model.model.{name.replace(_SAVED, '.')}"
    return None


def save_adapter(directory: str | Path, model: torch.nn.Module, spec, base_model: str, *,
                 full: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Collective: write a causal LM's adapters and modules to save in peft's format
    (`adapter_config.json`, `adapter_model.safetensors`), loadable with
    `PeftModel.from_pretrained(base, directory)`. `full` gathers one whole tensor (as in
    `merged_tensors`). Rank 0 writes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    full = full or _full
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    for name, p in model.named_parameters():
        key = adapter_file_key(name)
        if key is not None:
            whole = full(p)  # collective
            if rank0:
                state[key] = whole.to("cpu", torch.float32).contiguous()
    if not rank0:
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = lora_config(spec)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(directory))
    save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def trainable_parameters(model: torch.nn.Module) -> int:
    """Parameters the optimizer updates (global counts for sharded ones)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
