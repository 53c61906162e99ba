"""torchrun worker: for each `dp_shard,tp,cp` layout, the gradient norm of `grad_norm` vs
the norm of the whole gradients (`full_tensor` per parameter), the collectives it issues
(counted by `CommDebugMode`), clipping, and a NaN on one rank's shard.

`synthetic`: hand-placed gradients on a 2 x 2 mesh, every kind of placement per
dimension (a replicated dimension must not be summed), plus a plain gradient.

The model: a tiny Qwen2 with 4 key/value heads (so TP can be 4), biases on q/k/v (TP
shards them too). Rank 0 writes `{layout: {...}}` as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

from rlhf_trainer.data.balanced_packing import pack
from rlhf_trainer.parallel.context_parallel import cp_inputs
from rlhf_trainer.parallel.grad_norm import clip_grad_norm, grad_norm
from rlhf_trainer.parallel.parallelize import parallelize


def build() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).train()


def whole_norm(model: torch.nn.Module) -> float:
    """The reference: every gradient made whole, in float64."""
    sq = 0.0
    for p in model.parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        sq += g.double().square().sum().item()
    return math.sqrt(sq)


def placements(model: torch.nn.Module) -> list[str]:
    kinds = set()
    for p in model.parameters():
        g = p.grad
        kinds.add(type(g).__name__ if not isinstance(g, DTensor)
                  else ",".join(type(pl).__name__ for pl in g.placements))
    return sorted(kinds)


def run_layout(world: int, dp: int, tp: int, cp: int) -> dict:
    model = build()
    meshes = parallelize(model, world_size=world, dp_shard=dp, tp=tp, cp=cp,
                         activation_checkpointing=False, device_type="cpu")
    gen = torch.Generator().manual_seed(1 + meshes.dp_shard.get_local_rank())  # data differs across dp ranks
    docs = [torch.randint(2, 32, (n,), generator=gen).tolist() for n in (7, 9)]
    packed = pack(docs, pad_to_multiple_of=cp)
    inputs = cp_inputs(packed, meshes.cp if cp > 1 else None)
    logits = model(**inputs, use_cache=False).logits
    ids = inputs["input_ids"]
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()

    ref = whole_norm(model)
    params = list(model.parameters())
    with CommDebugMode() as comm:
        norm = grad_norm(params)
    collectives = comm.get_total_counts()
    max_norm = ref / 2
    clipped = clip_grad_norm(params, max_norm)
    after = whole_norm(model)

    # a NaN in one rank's shard of one gradient: every rank must see a non-finite norm
    shard = params[3].grad._local_tensor  # in place (the gradient itself)
    if dist.get_rank() == world - 1 and shard.numel():
        shard.view(-1)[0] = float("nan")
    finite = torch.tensor([float(torch.isfinite(grad_norm(params)))])
    finite_all = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(finite_all, finite)
    return {"norm": norm.item(), "ref": ref, "clipped_norm": clipped.item(), "after_clip": after,
            "max_norm": max_norm, "collectives": collectives,
            "dtensor_grads": sum(isinstance(p.grad, DTensor) for p in params),
            "plain_grads": sum(not isinstance(p.grad, DTensor) for p in params),
            "placements": placements(model), "finite_after_nan": [x.item() for x in finite_all]}


SYNTHETIC = [(Shard(0), Replicate()), (Replicate(), Shard(1)), (_StridedShard(0, split_factor=2), Shard(0)),
             (Shard(0), Shard(1)), (Replicate(), Replicate()), None]
"""Placements on the (2, 2) mesh; None: a plain (replicated) gradient."""


def run_synthetic(world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    gen = torch.Generator().manual_seed(3)  # the same whole gradients on every rank
    fulls = [torch.randn(8, 6, generator=gen) for _ in SYNTHETIC]
    params = []
    for full, placement in zip(fulls, SYNTHETIC):
        p = torch.nn.Parameter(torch.zeros(8, 6))
        p.grad = full.clone() if placement is None else distribute_tensor(full, mesh, list(placement))
        params.append(p)
    with CommDebugMode() as comm:
        norm = grad_norm(params)
    ref = math.sqrt(sum(f.double().square().sum().item() for f in fulls))
    return {"norm": norm.item(), "ref": ref, "collectives": comm.get_total_counts(),
            "dtensor_grads": len(SYNTHETIC) - 1, "plain_grads": 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("layouts", nargs="+", help="dp,tp,cp or synthetic")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {}
    try:
        for layout in args.layouts:
            if layout == "synthetic":
                results[layout] = run_synthetic(world)
                continue
            dp, tp, cp = (int(x) for x in layout.split(","))
            results[layout] = run_layout(world, dp, tp, cp)
    finally:
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
