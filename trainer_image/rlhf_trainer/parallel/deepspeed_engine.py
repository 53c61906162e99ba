"""DeepSpeed ZeRO as the second training engine (`trainer.engine: deepspeed`): stage 2
(optimizer state and gradients partitioned over the data-parallel ranks) or stage 3 (the
parameters too), with optional optimizer and parameter offload to the host.

The loops see the same two things as under FSDP2: the model (the Hugging Face module
itself; under ZeRO-3 DeepSpeed's hooks gather each submodule's parameters around its
forward and backward) and an optimizer, here a `ZeroOptimizer` owning the DeepSpeed engine,
whose `backward(loss, last=...)`, `step_or_skip()`, `zero_grad()` and `param_groups` the
shared code calls (optim.py `backward` / `step_or_skip` / `scale_lr`). Everything else is
shared: micro-batch planning, packed attention (`apply_cp(model, None)`), the chunked
log-prob head, losses, metrics.

Gradient convention: each rank's loss is its SHARE of the global loss and the gradients
are SUMMED over ranks (parallel/parallelize.py); DeepSpeed averages over data-parallel
ranks, so the loss is multiplied by the world size before its backward. The micro-batches
of one optimizer step are DeepSpeed's gradient accumulation: the last one is marked as the
boundary (`set_gradient_accumulation_boundary`), where ZeRO-2 reduces and the step runs.
Clipping is DeepSpeed's (`gradient_clipping` = trainer.maxGradNorm, the same min(1,
max / (norm + 1e-6)) rule); a non-finite norm makes ZeRO skip the step itself, reported
as skipped.

Frozen models (the reference, the reward model) run as ZeRO-3 inference engines at stage
3 (partitioned, no optimizer) and stay whole on every rank at stage 2. Checkpoints: each
trained part's engine writes its own ZeRO files into the step's directory
(`save_checkpoint(path, tag=part)`), the rest of the checkpoint (trainer state, RNG, the
COMPLETE marker) is as under FSDP2. Weight sync and export gather one parameter at a time
(`GatheredParameters`), never the whole model on one rank.

Optimizer: torch's AdamW (the same update as under FSDP2) as DeepSpeed's client optimizer;
DeepSpeed's CPU Adam (a JIT-built C++ op) with optimizer offload. Simplifications: models
are read whole into host memory on every rank before ZeRO partitions them (no
`zero.Init`), no tensor or context parallelism, no LoRA (both refused at admission).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def ds_config(optim, *, trains: bool, cuda: bool) -> dict[str, Any]:
    """DeepSpeed's config for a model of the trainer config's `optim` (OptimConfig)."""
    spec = optim.deepspeed
    zero: dict[str, Any] = {"stage": spec.zero_stage, "reduce_bucket_size": spec.reduce_bucket_size,
                            "contiguous_gradients": True, "overlap_comm": cuda}
    if spec.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = spec.param_persistence_threshold
        zero["stage3_prefetch_bucket_size"] = spec.reduce_bucket_size
        if spec.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if trains and spec.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "bf16": {"enabled": cuda}, "gradient_clipping": optim.max_grad_norm if trains else 0.0,
            "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
            "zero_allow_untested_optimizer": True}


def _client_optimizer(params: list[torch.nn.Parameter], optim, learning_rate: float, cuda: bool):
    if optim.deepspeed.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=learning_rate, weight_decay=optim.weight_decay, adamw_mode=True)
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=optim.weight_decay, foreach=not cuda,
                             fused=cuda or None)


class ZeroOptimizer:
    """The optimizer side of a model trained by DeepSpeed (see the module docstring)."""

    def __init__(self, engine, world_size: int):
        self.engine = engine
        self.world_size = world_size

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Backward of this rank's share of the loss; `last`: the optimizer step's last
        micro-batch (DeepSpeed's accumulation boundary)."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world_size)
        # DeepSpeed counts micro-batches (ZeRO-3: copy the first one's gradient partition,
        # add the later ones) in its engine's forward, which the loops do not call (they
        # call the module): done here, once the backward is complete. Without it every
        # micro-batch of a step overwrites the one before.
        self.engine.optimizer.clear_backward_seen_flag()

    def step_or_skip(self) -> torch.Tensor | None:
        """Clip and step (DeepSpeed's); the norm before clipping, or None when ZeRO skipped
        a non-finite step."""
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = torch.as_tensor(float("nan") if norm is None else float(norm), dtype=torch.float32)
        return norm if bool(torch.isfinite(norm)) else None

    def save(self, directory: str, tag: str) -> None:
        """Collective: this part's ZeRO state (parameters, optimizer) under `directory/tag`."""
        self.engine.save_checkpoint(directory, tag=tag, save_latest=False)

    def load(self, directory: str, tag: str) -> None:
        """Collective: restore what `save` wrote (same world size)."""
        path, _ = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"checkpoint {directory}: no DeepSpeed state for {tag}")


def is_zero(optimizer: Any) -> bool:
    return isinstance(optimizer, ZeroOptimizer)


def train_with_zero(model: torch.nn.Module, optim, learning_rate: float | None = None) -> ZeroOptimizer:
    """Hand `model` (on the host or its device) to a DeepSpeed engine that trains its
    trainable parameters; returns its optimizer side. Collective."""
    import deepspeed

    cuda = torch.cuda.is_available()
    params = [p for p in model.parameters() if p.requires_grad]
    client = _client_optimizer(params, optim, learning_rate or optim.learning_rate, cuda)
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=ds_config(optim, trains=True, cuda=cuda),
                                      dist_init_required=False)
    return ZeroOptimizer(engine, dist.get_world_size())


def frozen_with_zero(model: torch.nn.Module, optim) -> torch.nn.Module:
    """A frozen model: partitioned as a ZeRO-3 inference engine at stage 3; at stage 2
    whole on every rank (on its device). Returns the module the loops call. Collective."""
    cuda = torch.cuda.is_available()
    if optim.deepspeed.zero_stage != 3:
        return model.to(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=ds_config(optim, trains=False, cuda=cuda),
                                      dist_init_required=False)
    return engine.module


def is_partitioned(t: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (its data lives in shards across the ranks)."""
    return hasattr(t, "ds_id")


def full_shape(t: torch.Tensor) -> list[int]:
    return list(t.ds_shape) if is_partitioned(t) else list(t.shape)


def gathered(t: torch.Tensor) -> torch.Tensor:
    """Collective: a copy of the whole of a ZeRO-3 parameter on every rank."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
        return t.detach().clone()
