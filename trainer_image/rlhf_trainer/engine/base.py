"""The training-engine seam: what the loops, the checkpoints, the weight sync and the export
ask of a trained model, whatever trains it (FSDP2 with torch's AdamW: engine/fsdp2.py;
DeepSpeed ZeRO: engine/zero.py) and whether it carries LoRA adapters.

One `Engine` per trained model (the policy; the critic of PPO). Its `model` is the module
the loops call forward on. The loops then ask the engine, never the model or the
optimizer: `backward(loss, last=...)` per micro-batch, `step_or_skip(max_grad_norm)` per
optimizer step, `zero_grad()`, `scale_lr(factor)`; checkpoints ask for its state
(`dcp_state` / `load_dcp_state` for the parts saved with torch.distributed.checkpoint,
`save_files` / `load_files` for an engine's own files); the weight sync and the final export
ask for `full_tensors()` (Hugging Face names, whole tensors, LoRA adapters merged);
colocation asks it to `offload()` its parameters and optimizer state to the host while the
rollout engine runs on the same GPU, and to `reload()` them before the next update.

Not here: how models are laid out (parallel/parallelize.py) and loaded (models/loading.py);
an engine's `load_models` only picks which of those applies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import save_final
from ..models import lora

TensorSpecs = list[tuple[str, list[int], torch.dtype]]


@dataclass(frozen=True)
class PlannedState:
    """What an engine keeps on each GPU, for the memory plan (preflight/memory_plan.py):
    the trained model's persistent terms, the bytes per parameter of a frozen model (the
    reference, a teacher, the reward model), its own working buffers during a micro-batch,
    and whether FSDP's unsharded compute copies exist (a term the plan computes itself).
    Terms are (name, bytes, note)."""

    trained: list[tuple[str, int, str]]
    frozen_bytes: int
    """Bytes per parameter of a frozen model..."""
    frozen_shard: int
    """...divided over this many ranks."""
    fsdp_copies: bool
    micro_batch: list[tuple[str, int, str]] = field(default_factory=list)
    note: str = ""


class EngineStateError(RuntimeError):
    """The engine was asked to compute while its state is offloaded (call `reload()` first)."""


class Engine(ABC):
    """See the module docstring. `adapter`: (the `model.lora` spec, the base model's path)
    when the model is a causal LM with LoRA adapters, whose peft files the export writes."""

    def __init__(self, model: torch.nn.Module, *, adapter: tuple[Any, str] | None = None):
        self.model = model
        self.adapter = adapter
        self.offloaded = False

    @classmethod
    @abstractmethod
    def load_models(cls, config, info, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module | None, Any]:
        """Load and lay out the job's models as this engine trains them: (trained,
        reference, layout)."""

    @classmethod
    @abstractmethod
    def planned_state(cls, optim, *, params: float, trained: float, shard: int, cuda: bool) -> PlannedState:
        """The memory plan's view of this engine for a model of `params` parameters per rank
        (its tensor-parallel part divided by the `shard` data-parallel ranks; `trained` of
        them trained)."""

    # ---- one optimizer step ---------------------------------------------------------

    @abstractmethod
    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """The backward of one micro-batch's loss, this rank's SHARE of the global loss
        (gradients are summed over ranks); `last`: the optimizer step's last micro-batch."""

    @abstractmethod
    def step_or_skip(self, max_grad_norm: float) -> torch.Tensor | None:
        """Clip to `max_grad_norm` and step; a non-finite norm skips the step and drops
        the gradients. The norm before clipping (a tensor), or None when skipped."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop the gradients (set to None)."""

    @property
    @abstractmethod
    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups (their `lr` is what `scale_lr` sets)."""

    def scale_lr(self, factor: float) -> None:
        """Set every parameter group's rate to `factor` x its base rate (kept in `initial_lr`)."""
        for group in self.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor

    # ---- checkpoints ------------------------------------------------------------------

    def dcp_state(self) -> dict[str, Any] | None:
        """Collective: {"model", "optim"} state dicts saved by torch.distributed.checkpoint
        with the other parts in the step's directory; None when the engine writes files of
        its own (`save_files`)."""
        return None

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        """Restore what `dcp_state()` returned, after `dcp.load` filled it."""

    def save_files(self, directory: Path, tag: str) -> None:
        """Collective: write this part's own files under `directory` (engines that do not
        use `dcp_state`)."""

    def load_files(self, directory: Path, tag: str) -> None:
        """Collective: restore what `save_files` wrote."""

    @classmethod
    def wrote(cls, step_dir: Path, part: str) -> bool:
        """Whether this engine wrote `part` of the checkpoint `step_dir` (its layout on disk)."""
        return False

    @classmethod
    def read_trained(cls, step_dir: Path, part: str) -> dict[str, torch.Tensor]:
        """`part`'s trained tensors in the checkpoint `step_dir`, whole, by Hugging Face name,
        read in one process without a GPU (`rlhfctl export`). Torch's DCP files by default."""
        import warnings

        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from ..checkpoint import SafeReader

        reader = SafeReader(str(step_dir))  # DCP's metadata pickle read with DCP's classes only
        prefix = f"{part}.model."
        state = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
                 for key, meta in reader.read_metadata().state_dict_metadata.items()
                 if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
        if state:
            import torch.distributed.checkpoint as dcp

            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({part: {"model": state}}, storage_reader=reader)
        return state

    # ---- whole parameters ---------------------------------------------------------------

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: the whole of one parameter or state entry, on every rank."""
        return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()

    def export_items(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The named tensors the final export writes (parameters and persistent buffers)."""
        return self.model.state_dict().items()

    def full_tensors(self, items: Iterable[tuple[str, torch.Tensor]] | None = None
                     ) -> tuple[TensorSpecs, Iterator[torch.Tensor]]:
        """(name, shape, dtype) of every parameter as the merged Hugging Face model names
        it, and a generator of the whole tensors (LoRA: W + scaling x B A). Collective:
        every rank must run the generator to its end."""
        self._check_loaded("gather parameters")
        return lora.merged_tensors(self.model, self.model.named_parameters() if items is None else items,
                                   full=self.gather, shape=self.full_shape)

    def full_shape(self, tensor: torch.Tensor) -> list[int]:
        return list(tensor.shape)

    def numel(self, tensor: torch.Tensor) -> int:
        """A parameter's global size (a DTensor's numel is global already)."""
        return tensor.numel()

    def trainable_parameters(self) -> int:
        return sum(self.numel(p) for p in self.model.parameters() if p.requires_grad)

    def total_parameters(self) -> int:
        return sum(self.numel(p) for p in self.model.parameters())

    def export(self, output_dir: str | Path, tokenizer: Any, name: str = "final") -> Path | None:
        """Collective: the model as a Hugging Face directory (`<output>/<name>/`, `final`
        by default), with the adapters in peft's format under `<name>/adapter/` when the
        model has them."""
        return save_final(output_dir, self.model, tokenizer, tensors=self.full_tensors(self.export_items()),
                          lora=self.adapter, gather=self.gather, name=name)

    # ---- colocation ---------------------------------------------------------------------

    @abstractmethod
    def _move_states(self, device: torch.device, *, offload: bool) -> None:
        """Move the parameters and optimizer state to `device` (`offload`: to the host,
        else back to where the engine computes; on a CPU-only machine both are the CPU)."""

    def offload(self) -> None:
        """Move parameters and optimizer state to the host (idempotent) and release the
        accelerator's cached blocks, so a rollout engine may use the memory."""
        if self.offloaded:
            return
        self.zero_grad()
        self._move_states(torch.device("cpu"), offload=True)
        self.offloaded = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring back what `offload` moved (idempotent)."""
        if not self.offloaded:
            return
        self._move_states(self.device, offload=False)
        self.offloaded = False

    @property
    def device(self) -> torch.device:
        """Where the engine computes."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_loaded(self, what: str) -> None:
        if self.offloaded:
            raise EngineStateError(f"cannot {what}: the engine's state is offloaded to the host; call reload() first")


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move a torch optimizer's state tensors to `device`. AdamW's `step` counter is a host
    scalar unless the kernel is fused or capturable: it stays where the optimizer keeps it."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    step_on_device = bool(group.get("fused") or group.get("capturable"))
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and (step_on_device or not (key == "step" and value.dim() == 0)):
                per_param[key] = value.to(device)
