"""LoRA (`model.lora`): low-rank adapters, injected by peft into the model itself
(`inject_adapter_in_model`: the model keeps its class, its `lm_head`, its decoder layers),
trained on a frozen base.

- Only the adapters (and a score model's `score` head) require gradients, so the
  optimizer, gradients and checkpoints (`checkpoint.py` saves trainable state only) hold
  the adapters alone.
- The reference model is the base itself: `AdaptersOff(policy)` runs the policy with every
  adapter disabled; no second copy is loaded.
- Adapters start as peft starts them (A: Kaiming-uniform, B: 0, so the first policy is the
  base), drawn from `schedule.seed` in one fixed order, so one process and a sharded run
  start from the same adapters.
- Weight sync and the final export see the merged model (`merged_tensors`): Hugging Face
  names, W + (alpha / r) B A computed tensor by tensor as they are gathered; nothing in
  the model is merged in place. The rollout servers therefore need no LoRA support and
  receive exactly the weights the trainer computes with.
- `save_adapter` writes the adapters in peft's own format (`final/adapter/`) as well.

Names: peft renames a wrapped layer's weight `x.weight` -> `x.base_layer.weight` and adds
`x.lora_A.default.weight` [r, in] and `x.lora_B.default.weight` [out, r].
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


def lora_config(spec, *, exclude: Iterable[str] = ()):
    """peft's `LoraConfig` of a `model.lora` spec."""
    from peft import LoraConfig

    targets = spec.target_modules
    target = targets[0] if targets == ["all-linear"] else list(targets)
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=target,
                      exclude_modules=list(exclude) or None, bias="none")


def add_adapters(model: torch.nn.Module, spec) -> torch.nn.Module:
    """Inject adapters into `model` in place (any device, meta included); freeze the rest
    but a score head. Raises ValueError naming `model.lora.targetModules` when no linear
    layer matched or a match is not linear."""
    from peft import inject_adapter_in_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    heads = [name for name in TRAINED_HEADS if isinstance(getattr(model, name, None), torch.nn.Linear)]
    try:
        inject_adapter_in_model(lora_config(spec, exclude=heads), model)
    except ValueError as err:
        raise ValueError(f"model.lora.targetModules: {spec.target_modules} matched no layer of the model ({err}); "
                         "name linear layers such as q_proj, v_proj, or use all-linear") from None
    wrapped = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and isinstance(head, BaseTunerLayer):
        raise ValueError("model.lora.targetModules: the output head (lm_head) cannot have an adapter (the trainer "
                         "computes log-probs from its weight directly); leave it out, all-linear does")
    odd = {name: kind for name, kind in wrapped.items() if not isinstance(model.get_submodule(name), LoraLinear)}
    if odd:
        raise ValueError(f"model.lora.targetModules: {sorted(odd)[:3]} are not linear layers ({sorted(set(odd.values()))}); "
                         "only linear layers get adapters")
    for name, p in model.named_parameters():
        p.requires_grad_(_A in name or _B in name or name.split(".")[0] in heads)
    return model


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """Each wrapped layer's name -> alpha / r (what B A is multiplied by)."""
    from peft.tuners.lora import LoraLayer

    return {name: float(m.scaling[ADAPTER]) for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def initial_adapters(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter's starting value (CPU, fp32) by parameter name: A Kaiming-uniform as
    peft draws it, B zero; from `seed`, in parameter order, whatever the layout."""
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
    """The key of a model state entry in the base model's files (None: an adapter)."""
    if _A in name or _B in name:
        return None
    return name.replace(_BASE, ".")


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run `model` as its base: every adapter layer off (peft's flag, read by its forward;
    set directly so that no parameter's requires_grad changes under FSDP)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
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
    """The whole tensor (collective for FSDP's DTensors); engines that shard otherwise pass
    their own (engine/base.py `Engine.gather`)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def merged_tensors(model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]], *,
                   full: Callable[[torch.Tensor], torch.Tensor] = _full,
                   shape: Callable[[torch.Tensor], list[int]] = lambda t: list(t.shape),
                   ) -> tuple[list[tuple[str, list[int], torch.dtype]], Iterator[torch.Tensor]]:
    """(name, shape, dtype) of every entry of `items` (`named_parameters()` or
    `state_dict().items()`) as the merged model names it, and a generator of the full
    tensors in that order: W + scaling x B A for wrapped weights, computed in fp32 and
    returned in W's dtype. Collective for sharded tensors: every rank must run the
    generator to its end. Without adapters: the entries as they are."""
    items = list(items)
    lookup = dict(items)
    scale = scalings(model)
    specs, plan = [], []
    for name, tensor in items:
        if _A in name or _B in name:
            continue
        merged = None
        if _BASE in name:
            layer, leaf = name.split(_BASE, 1)
            if leaf == "weight":
                merged = (lookup[f"{layer}{_A}weight"], lookup[f"{layer}{_B}weight"], scale[layer])
            name = f"{layer}.{leaf}"
        specs.append((name, shape(tensor), tensor.dtype))
        plan.append((tensor, merged))

    def tensors() -> Iterator[torch.Tensor]:
        for tensor, merged in plan:
            whole = full(tensor)
            if merged is not None:
                a, b, s = merged
                whole = (whole.float() + (full(b).float() @ full(a).float()) * s).to(whole.dtype)
            yield whole

    return specs, tensors()


def save_adapter(directory: str | Path, model: torch.nn.Module, spec, base_model: str, *,
                 full: Callable[[torch.Tensor], torch.Tensor] = _full) -> None:
    """Collective: write a causal LM's adapters in peft's format (`adapter_config.json`,
    `adapter_model.safetensors`), loadable with `PeftModel.from_pretrained(base, directory)`.
    Rank 0 writes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    for name, p in model.named_parameters():
        if _A in name or _B in name:
            whole = full(p)  # collective
            if rank0:  # peft's file keys: the PeftModel's prefix, no adapter name
                state[f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}"] = whole.to("cpu", torch.float32).contiguous()
    if not rank0:
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = lora_config(spec)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(directory))
    save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def trainable_parameters(model: torch.nn.Module) -> int:
    """Parameters the optimizer updates (global counts for DTensors; engines that shard
    otherwise count their own: engine/base.py `Engine.trainable_parameters`)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
