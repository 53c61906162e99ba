"""Build the device mesh and apply every parallelism to a Hugging Face causal LM.

The world is a 3-D mesh `(dp_shard, cp, tp)` (sizes may be 1; tp innermost so a TP
group is the closest ranks, i.e. one node's GPUs under torchrun), plus the flattened
dimension `dp_shard_cp` that FSDP shards over: context-parallel ranks hold the same
parameters and see different tokens, so for the weights they are data parallel.

Loss and gradient convention: FSDP here SUMS gradients over `dp_shard_cp` (divide factor
1), so each rank's loss must be its share of the global loss (the train step weights each
token by aggregation coefficients computed on the whole mini-batch: rl/step.py).
TP ranks of one (dp, cp) coordinate compute the same loss and are not summed.

`parallelize_models` lays out the policy, the reference model and the critic together
and returns the `Layout` the train step sees (it never sees a mesh otherwise). On CUDA
every layout, one GPU included, goes through FSDP2 (a mesh of one), whose mixed
precision policy computes in bf16 with fp32 master weights, gradients reduced in fp32,
and fp32 optimizer state.

Simplifications: no pipeline parallelism, no replicated data parallelism (HSDP), no
torch.compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, FSDPModule, fully_shard

from rlhf_contract.api.rules import TP_WITH_CRITIC, TP_WITH_REWARD_MODEL

from .context_parallel import apply_cp
from .layers import decoder_layers
from .tensor_parallel import apply_tp

MESH_DIMS = ("dp_shard", "cp", "tp")
FSDP_DIM = "dp_shard_cp"


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the 1-D meshes cut from it (each exists even when of size 1)."""

    world: DeviceMesh
    """3-D `(dp_shard, cp, tp)`."""
    dp_shard: DeviceMesh
    """Ranks with different data and different parameter shards (CP excluded)."""
    cp: DeviceMesh
    """Ranks sharing one packed row, each holding a contiguous slice of it."""
    tp: DeviceMesh
    """Ranks sharing each layer's weights (heads / MLP columns)."""
    dp_shard_cp: DeviceMesh
    """Flattened dp_shard x cp: FSDP shards and sums gradients over it."""


def build_mesh(*, world_size: int, dp_shard: int, tp: int, cp: int, device_type: str) -> Meshes:
    """The `(dp_shard, cp, tp)` world mesh and its 1-D meshes, `dp_shard_cp` flattened."""
    sizes = {"dp_shard": dp_shard, "tp": tp, "cp": cp}
    bad = [f"{k} ({v})" for k, v in sizes.items() if v < 1]
    if bad:
        raise ValueError(f"trainer.parallelism: sizes must be at least 1: {', '.join(bad)}")
    if dp_shard * tp * cp != world_size:
        raise ValueError(
            f"trainer.parallelism: dp_shard ({dp_shard}) x tp ({tp}) x cp ({cp}) = "
            f"{dp_shard * tp * cp} must equal the number of trainer processes ({world_size}); "
            f"change the parallel sizes or trainer.numNodes x trainer.nprocPerNode"
        )
    world = init_device_mesh(device_type, (dp_shard, cp, tp), mesh_dim_names=MESH_DIMS)
    # `_flatten` is private but the only way to make a flattened sub-mesh (torchtitan does
    # the same); we keep the result instead of slicing it back out of the root mesh.
    flat = world["dp_shard", "cp"]._flatten(mesh_dim_name=FSDP_DIM)
    return Meshes(world=world, dp_shard=world["dp_shard"], cp=world["cp"], tp=world["tp"], dp_shard_cp=flat)


def apply_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Recompute every decoder layer in backward (non-reentrant).

    Uses transformers' own per-layer checkpointing, which keeps parameter names
    unchanged (a `checkpoint_wrapper` would insert `_checkpoint_wrapped_module.`) and
    runs the layer's forward hooks inside the checkpoint, which FSDP2 supports.
    """
    model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def apply_fsdp_summed(model: torch.nn.Module, dp_mesh: DeviceMesh) -> torch.nn.Module:
    """FSDP2 over `dp_mesh`, one unit per decoder layer plus the root, with gradients
    SUMMED (not averaged) over the mesh. On CUDA, bf16 compute with fp32 master weights
    and fp32 gradient reduction (not exercised by the CPU tests)."""
    kwargs = {}
    if dp_mesh.device_type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # With factor 1, plain SUM collectives (gloo has no PREMUL_SUM).
            module.set_force_sum_reduction_for_comms(True)
    return model


def parallelize(
    model: torch.nn.Module,
    *,
    world_size: int,
    dp_shard: int,
    tp: int,
    cp: int,
    activation_checkpointing: bool,
    device_type: str,
) -> Meshes:
    """Apply TP, CP, activation checkpointing and FSDP to `model` in place; return the
    meshes (`world` = `(dp_shard, cp, tp)`, each 1-D mesh, and flattened `dp_shard_cp`).

    Requires an initialized default process group of `world_size` ranks and the model on
    `device_type` already.
    """
    meshes = build_mesh(world_size=world_size, dp_shard=dp_shard, tp=tp, cp=cp, device_type=device_type)
    # Order matters:
    # 1. TP first: it replaces Linear weights with DTensors on the tp mesh; FSDP must
    #    see those DTensors to shard them a second time (2-D) over dp_shard_cp.
    # 2. CP next: it swaps the attention function only (no parameters, no wrappers), so it
    #    could go anywhere before FSDP; we keep torchtitan's order.
    # 3. Activation checkpointing wraps each layer's forward, TP and CP collectives
    #    included (they rerun in the recompute, in the same order on every rank). It must
    #    come before FSDP so that FSDP's per-layer hooks sit inside the checkpointed call:
    #    FSDP's pre-backward all-gather then covers the recompute.
    # 4. FSDP last, per layer then the root: it must see the final parameters (TP's
    #    DTensors included) and the final module tree.
    if tp > 1:
        apply_tp(model, meshes.tp)
    apply_cp(model, meshes.cp if cp > 1 else None)  # without CP: per-document attention from explicit bounds
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if dp_shard * cp > 1 or device_type == "cuda":
        apply_fsdp_summed(model, meshes.dp_shard_cp)
    return meshes


@dataclass(frozen=True)
class Layout:
    """What the train step needs to know of the parallel layout."""

    world_size: int = 1
    dp_size: int = 1
    """Data-parallel ranks (each gets its own balanced share of the sequences)."""
    dp_rank: int = 0
    cp_mesh: DeviceMesh | None = None
    """Context-parallel mesh (None: no context parallelism)."""
    reduce_group: dist.ProcessGroup | None = None
    """dp_shard x cp: where gradients and step metrics are summed (None: one process)."""
    reduce_size: int = 1
    owns_rows: bool = True
    """First of its tensor / context parallel peers (which see the same sequences): the
    rank that contributes their per-token results when tables are assembled."""

    @property
    def cp_size(self) -> int:
        return self.cp_mesh.size() if self.cp_mesh is not None else 1


def parallelize_models(policy: torch.nn.Module, *, ref: torch.nn.Module | None, critic: torch.nn.Module | None,
                       world_size: int, tp: int, cp: int, activation_checkpointing: bool,
                       device_type: str, reward_model: torch.nn.Module | None = None) -> Layout:
    """TP -> CP -> activation checkpointing -> FSDP2 for the policy (`parallelize`); the
    reference model, the critic and the reward model are laid out on the same meshes, the
    critic (which trains) checkpointed like the policy, the frozen ones never (they run no
    backward)."""
    if tp > 1 and reward_model is not None:  # the contract's rule, refused at admission and in preflight
        raise ValueError(TP_WITH_REWARD_MODEL.problem(f"got {tp}"))
    if tp > 1 and critic is not None:
        raise ValueError(TP_WITH_CRITIC.problem(f"got {tp}"))
    if world_size == 1 and device_type != "cuda":
        for model in (policy, ref, critic, reward_model):
            if model is not None:
                apply_cp(model.model if model is critic else model, None)
        return Layout()
    dp = world_size // (tp * cp)
    meshes = parallelize(policy, world_size=world_size, dp_shard=dp, tp=tp, cp=cp,
                         activation_checkpointing=activation_checkpointing, device_type=device_type)
    for extra in (ref, critic, reward_model):
        if extra is None:
            continue
        if tp > 1:
            apply_tp(extra, meshes.tp)
        apply_cp(extra.model if extra is critic else extra, meshes.cp if cp > 1 else None)
        if extra is critic and activation_checkpointing:
            apply_activation_checkpointing(critic)
        if dp * cp > 1 or device_type == "cuda":
            apply_fsdp_summed(extra, meshes.dp_shard_cp)
    fsdp = dp * cp > 1
    return Layout(world_size=world_size, dp_size=dp, dp_rank=meshes.dp_shard.get_local_rank(),
                  cp_mesh=meshes.cp if cp > 1 else None,
                  reduce_group=meshes.dp_shard_cp.get_group() if fsdp else None, reduce_size=dp * cp,
                  owns_rows=meshes.tp.get_local_rank() == 0 and meshes.cp.get_local_rank() == 0)


def zero_layout(policy: torch.nn.Module, *, ref: torch.nn.Module | None, critic: torch.nn.Module | None,
                reward_model: torch.nn.Module | None, world_size: int, activation_checkpointing: bool) -> Layout:
    """The layout under DeepSpeed (engine/zero.py): data parallel over the
    whole world, packed per-document attention, the policy and the critic checkpointed
    when asked; ZeRO itself is applied when the engines are created."""
    for model in (policy, ref, critic, reward_model):
        if model is not None:
            apply_cp(model.model if model is critic else model, None)
    if activation_checkpointing:
        for model in (policy, critic):
            if model is not None:
                apply_activation_checkpointing(model)
    if world_size == 1:
        return Layout()
    return Layout(world_size=world_size, dp_size=world_size, dp_rank=dist.get_rank(), cp_mesh=None,
                  reduce_group=dist.group.WORLD, reduce_size=world_size, owns_rows=True)
