"""DeepSpeed ZeRO as the second training engine (`trainer.engine: deepspeed`): stage 2
(optimizer state and gradients partitioned over the data-parallel ranks) or stage 3 (the
parameters too), with optional optimizer and parameter offload to the host.

The loops see the engine interface of engine/base.py, as under FSDP2: `model` is the
Hugging Face module itself (under ZeRO-3 DeepSpeed's hooks gather each submodule's
parameters around its forward and backward), and `ZeroEngine` runs backward, step,
checkpoint files, gathering and offload through the DeepSpeed engine it owns. Everything
else is shared: micro-batch planning, packed attention (`apply_cp(model, None)`), the
chunked log-prob head, losses, metrics.

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
(`save_files`: `save_checkpoint(path, tag=part)`), the rest of the checkpoint (trainer state, RNG, the
COMPLETE marker) is as under FSDP2; DeepSpeed reads its files back as data only
(`data_only_loads`: no pickle runs code). Weight sync and export gather one parameter at a time
(`GatheredParameters`), never the whole model on one rank.

Optimizer: torch's AdamW (the same update as under FSDP2) as DeepSpeed's client optimizer;
DeepSpeed's CPU Adam (a JIT-built C++ op) with optimizer offload. Simplifications: models
are read whole into host memory on every rank before ZeRO partitions them (no
`zero.Init`), no tensor or context parallelism, no LoRA (both refused at admission).
Offload for colocation is DeepSpeed's `offload_states` / `reload_states`; a job that
already offloads the optimizer or the parameters (`trainer.deepspeed.offload*`) has
nothing more to move.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..models.loading import host_until_sharded, load_causal_lm
from ..models.logprob_head import attach_logprob_head
from ..parallel.parallelize import zero_layout
from .base import Engine, PlannedState, move_optimizer_state


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


def _deepspeed_classes() -> list[type]:
    """The plain classes DeepSpeed pickles into its checkpoint files (ZeRO stage 2 and 3,
    bf16 and fp16; found with torch.serialization.get_unsafe_globals_in_checkpoint)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextlib.contextmanager
def data_only_loads() -> Iterator[None]:
    """Within: every `torch.load` reads data only (`weights_only=True`, DeepSpeed's own plain
    classes allowed), whatever its caller asks. DeepSpeed's checkpoint engine and its
    `zero_to_fp32` ask for `weights_only=False`, so a planted file would run its code in the
    trainer (or in `rlhfctl export`); here it is refused (pickle.UnpicklingError). Not thread
    safe: checkpoints are loaded on the main thread."""
    load = torch.load
    allowed = _deepspeed_classes()

    def data_only(f, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            return load(f, *args, **kwargs)

    torch.load = data_only
    try:
        yield
    finally:
        torch.load = load


class ZeroEngine(Engine):
    """A model trained by DeepSpeed (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, ds_engine, world_size: int, *, offloads: bool = False):
        super().__init__(model)
        self.ds = ds_engine
        self.world_size = world_size
        self.offloads = offloads  # optimizer or parameters already live on the host (trainer.deepspeed.offload*)

    @classmethod
    def planned_state(cls, optim, *, params: float, trained: float, shard: int, cuda: bool) -> PlannedState:
        """ds_config's layout: bf16 module weights on GPUs (partitioned at stage 3, none on the
        GPU with parameter offload), fp32 master weights, gradient partitions and AdamW state
        partitioned over the data-parallel ranks (on the host with optimizer offload); frozen
        models partitioned at stage 3, whole at stage 2; the gradient reduction buckets (and
        ZeRO-3's prefetch bucket) during a micro-batch. Read from ds_config, not measured on a GPU."""
        spec = optim.deepspeed
        size, stage3 = (2 if cuda else 4), spec.zero_stage == 3
        weights = 0 if stage3 and spec.offload_params else size * params * (1 if stage3 else shard)
        terms = [(f"policy weights ({'bf16' if cuda else 'fp32'}, "
                  + ("on the host" if weights == 0 else "partitioned" if stage3 else "whole") + ")", int(weights),
                  f"ZeRO-{spec.zero_stage}")]
        if not spec.offload_optimizer:
            if cuda:
                terms.append(("fp32 master weights (partitioned)", int(4 * trained), "bf16 training"))
            terms += [("gradient partitions (fp32)", int(4 * trained), "reduce-scattered at the boundary"),
                      ("AdamW state (fp32, partitioned)", int(8 * trained), "exp_avg + exp_avg_sq")]
        buckets = [("ZeRO reduction buckets", int(2 * spec.reduce_bucket_size * size),
                    "reduce bucket + contiguous gradients buffer")]
        if stage3:
            buckets.append(("ZeRO-3 prefetch bucket", int(spec.reduce_bucket_size * size), "gathered parameters"))
        return PlannedState(trained=terms, frozen_bytes=size, frozen_shard=shard if stage3 else 1, fsdp_copies=False,
                            micro_batch=buckets,
                            note=f"trainer.engine deepspeed (ZeRO-{spec.zero_stage}"
                                 + (", optimizer on the host" if spec.offload_optimizer else "")
                                 + "): the plan follows its config, not measured on a GPU")

    @classmethod
    def train(cls, model: torch.nn.Module, optim, learning_rate: float | None = None, *,
              adapter: tuple[Any, str] | None = None) -> "ZeroEngine":
        """Hand `model` (on the host or its device) to a DeepSpeed engine that trains its
        trainable parameters. Collective. LoRA is refused at admission under DeepSpeed."""
        import deepspeed

        if adapter is not None:
            raise ValueError("model.lora: LoRA adapters train under trainer.engine fsdp2 only")
        cuda = torch.cuda.is_available()
        params = [p for p in model.parameters() if p.requires_grad]
        client = _client_optimizer(params, optim, learning_rate or optim.learning_rate, cuda)
        engine, *_ = deepspeed.initialize(model=model, optimizer=client,
                                          config=ds_config(optim, trains=True, cuda=cuda), dist_init_required=False)
        spec = optim.deepspeed
        return cls(model, engine, dist.get_world_size(), offloads=spec.offload_optimizer or spec.offload_params)

    @classmethod
    def load_models(cls, config, info, **kwargs):
        return load_for_zero(config, info, **kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.ds.optimizer.param_groups

    def zero_grad(self) -> None:
        self.ds.zero_grad()

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Backward of this rank's share of the loss; `last`: the optimizer step's last
        micro-batch (DeepSpeed's accumulation boundary)."""
        self._check_loaded("backward")
        self.ds.set_gradient_accumulation_boundary(last)
        self.ds.backward(loss * self.world_size)
        # DeepSpeed counts micro-batches (ZeRO-3: copy the first one's gradient partition,
        # add the later ones) in its engine's forward, which the loops do not call (they
        # call the module): done here, once the backward is complete. Without it every
        # micro-batch of a step overwrites the one before.
        self.ds.optimizer.clear_backward_seen_flag()

    def step_or_skip(self, max_grad_norm: float) -> torch.Tensor | None:
        """Clip (DeepSpeed's `gradient_clipping`, set from the same trainer.maxGradNorm) and
        step; the norm before clipping, or None when ZeRO skipped a non-finite step."""
        self._check_loaded("step")
        self.ds.set_gradient_accumulation_boundary(True)
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = torch.as_tensor(float("nan") if norm is None else float(norm), dtype=torch.float32)
        return norm if bool(torch.isfinite(norm)) else None

    @classmethod
    def wrote(cls, step_dir: Path, part: str) -> bool:
        return any((Path(step_dir) / part).glob("*model_states.pt"))

    @classmethod
    def read_trained(cls, step_dir: Path, part: str) -> dict[str, torch.Tensor]:
        """The ZeRO files of `step_dir/part/` keep the fp32 weights in the optimizer's
        partitions: DeepSpeed's own `zero_to_fp32` merges them (as data only)."""
        import sys

        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(sys.stderr), data_only_loads():  # it prints its progress; no pickle runs code
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=part))

    def save_files(self, directory: Path, tag: str) -> None:
        """Collective: this part's ZeRO state (parameters, optimizer) under `directory/tag`."""
        self.ds.save_checkpoint(str(directory), tag=tag, save_latest=False)

    def load_files(self, directory: Path, tag: str) -> None:
        """Collective: restore what `save_files` wrote (same world size)."""
        with data_only_loads():
            path, _ = self.ds.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"checkpoint {directory}: no DeepSpeed state for {tag}")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: the whole of a ZeRO-3 parameter (one at a time, never the whole model)."""
        if not _partitioned(tensor):
            return super().gather(tensor)
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            return tensor.detach().clone()

    def full_shape(self, tensor: torch.Tensor) -> list[int]:
        return list(tensor.ds_shape) if _partitioned(tensor) else list(tensor.shape)

    def numel(self, tensor: torch.Tensor) -> int:
        return int(tensor.ds_numel) if _partitioned(tensor) else tensor.numel()

    def export_items(self):
        """ZeRO-3's state_dict() holds empty partitions: its parameters, gathered one by one."""
        return self.model.named_parameters()

    def _move_states(self, device: torch.device, *, offload: bool) -> None:
        """DeepSpeed's own `offload_states` / `reload_states`; nothing to move when its
        optimizer or parameters already live on the host. ZeRO-3 moves the fp32 master
        partitions and the optimizer's moments only for its own FusedAdam: with torch's
        AdamW (our client optimizer) they are moved here, the rest by DeepSpeed."""
        from deepspeed.ops.adam import FusedAdam
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        if self.offloads:
            return
        zero = self.ds.optimizer
        by_hand = self.ds.zero_optimization_stage() == 3 and not isinstance(zero.optimizer, FusedAdam)
        if offload:
            include = ([OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads,
                        OffloadStateTypeEnum.contiguous_grad_buffer] if by_hand else None)
            self.ds.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=torch.cuda.is_available())
        else:
            self.ds.reload_states()
        if by_hand:
            for flat in zero.fp32_partitioned_groups_flat:
                flat.data = flat.data.to(device)
            move_optimizer_state(zero.optimizer, device)


def _partitioned(t: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (its data lives in shards across the ranks)."""
    return hasattr(t, "ds_id")


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


def load_for_zero(config, info, *, trained: torch.nn.Module | None = None, reference=None,
                  critic: torch.nn.Module | None = None, reward_model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, torch.nn.Module | None, Any]:
    """DeepSpeed: every rank reads the models whole on the host (GPUs) or its device (CPU);
    the trained ones go to ZeRO with their optimizer (`ZeroEngine.train`), the frozen
    ones here (ZeRO-3 inference at stage 3). Packed attention and checkpointing as under
    FSDP2."""
    host = host_until_sharded(info.device)
    lm = trained is None
    model = load_causal_lm(config.model_path, host) if lm else trained
    ref_dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32
    ref = (load_causal_lm(reference.path, host, ref_dtype).eval().requires_grad_(False)
           if reference is not None else None)  # the starting model, or a distillation teacher (no LoRA here)
    # decided once before any model loads (main.py: preflight.with_checkpointing_decided)
    checkpointing = bool(config.optim.parallelism.activation_checkpointing)
    layout = zero_layout(model, ref=ref, critic=critic, reward_model=reward_model, world_size=info.world_size,
                         activation_checkpointing=checkpointing)
    for m in ((model, ref) if lm else (ref,)):
        if m is not None:
            attach_logprob_head(m)
    for frozen in (ref, reward_model):
        if frozen is not None:
            frozen_with_zero(frozen, config.optim)
    return model, ref, layout
