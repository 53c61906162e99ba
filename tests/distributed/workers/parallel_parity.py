"""torchrun worker: for each `dp_shard,tp,cp[,ac][,llama]` layout, the parallel loss and gradients
of a next-token loss over packed documents vs one process forwarding each document alone.

Every rank computes the single-process reference itself (the model is tiny). Rank 0
writes `{layout: {loss, ref_loss, grad_rel_err, worst, names_match}}` as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlhf_trainer.data.balanced_packing import balanced_micro_batches, pack
from rlhf_trainer.models.builtin import build_tiny_qwen2
from rlhf_trainer.parallel.context_parallel import cp_inputs, shard_sequence
from rlhf_trainer.parallel.parallelize import parallelize

LENGTHS = [5, 9, 3, 12, 7, 4, 8, 6]
BUDGET = 20  # tokens per micro-batch: 2-3 micro-batches per rank, some documents share one


def documents() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 16, (n,), generator=gen).tolist() for n in LENGTHS]


def nll_sum(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -(logp * weights).sum()


def build(family: str) -> torch.nn.Module:
    """The built-in tiny Qwen2, or a Llama of the same shape (no q/k/v biases)."""
    if family == "qwen2":
        return build_tiny_qwen2(0).train()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=None, eos_token_id=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config).train()


def reference(docs, family: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, each document forwarded on its own (no packing, no mask tricks)."""
    model = build(family)
    count = sum(len(d) - 1 for d in docs)
    total = 0.0
    for d in docs:
        ids = torch.tensor([d])
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = nll_sum(logits, ids[:, 1:], torch.ones(1, len(d) - 1)) / count
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def global_token_mean(local_sum: torch.Tensor, local_count: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of the global token mean (summed over the group: the mean)."""
    count = torch.as_tensor(local_count, dtype=torch.float64).detach().clone().reshape(())
    dist.all_reduce(count, group=group)
    return local_sum / count.to(local_sum.dtype).clamp(min=1)


def targets_and_weights(packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token within the same document, over the WHOLE row (before CP sharding)."""
    ids, doc = packed.input_ids, packed.document_ids
    num_docs = len(packed.cu_seqlens) - 1
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    same = torch.cat([doc[:, 1:] == doc[:, :-1], torch.zeros_like(doc[:, :1], dtype=torch.bool)], dim=1)
    return targets, (same & (doc < num_docs)).float()


def run_layout(world: int, dp: int, tp: int, cp: int, ac: bool, family: str, docs) -> dict:
    ref_loss, ref_grads = reference(docs, family)
    model = build(family)
    meshes = parallelize(model, world_size=world, dp_shard=dp, tp=tp, cp=cp,
                         activation_checkpointing=ac, device_type="cpu")
    cp_mesh = meshes.cp if cp > 1 else None
    group = meshes.dp_shard_cp.get_group()
    dp_rank = meshes.dp_shard.get_local_rank()
    mlp_calls = []  # the MLP runs inside the checkpointed region: twice per pass with AC
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    micro = balanced_micro_batches([len(d) for d in docs], BUDGET, dp)[dp_rank]

    rows = []
    for mb in micro:  # empty micro-batches still run (FSDP lockstep) with zero weight
        packed = pack([docs[i] for i in mb], pad_to_multiple_of=cp)
        targets, weights = targets_and_weights(packed)
        rows.append((packed, shard_sequence(targets, cp_mesh), shard_sequence(weights, cp_mesh)))
    local_count = sum(w.sum() for _, _, w in rows)

    loss_value = torch.zeros((), dtype=torch.float64)
    for packed, targets, weights in rows:
        # the trainer's own inputs: per-document attention from explicit bounds (CP: whole-row document ids)
        logits = model(**cp_inputs(packed, cp_mesh), use_cache=False).logits
        loss = global_token_mean(nll_sum(logits, targets, weights), local_count, group)
        loss.backward()
        loss_value += loss.detach().double()
    dist.all_reduce(loss_value, group=group)

    worst, worst_name = 0.0, ""
    names = []
    for name, p in model.named_parameters():
        names.append(name)
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        ref = ref_grads[name]
        err = ((g - ref).norm() / ref.norm().clamp(min=1e-30)).item()
        if err > worst:
            worst, worst_name = err, name
    return {"loss": loss_value.item(), "ref_loss": ref_loss, "grad_rel_err": worst, "worst": worst_name,
            "family": family, "names_match": names == list(ref_grads), "passes": len(rows), "mlp_calls": len(mlp_calls)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("layouts", nargs="+", help="dp,tp,cp[,ac][,llama]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    docs = documents()
    results = {}
    try:
        for layout in args.layouts:
            parts = layout.split(",")
            dp, tp, cp = (int(x) for x in parts[:3])
            family = "llama" if "llama" in parts[3:] else "qwen2"
            results[layout] = run_layout(world, dp, tp, cp, "ac" in parts[3:], family, docs)
        dist.barrier()  # every rank's collectives done before any tears its process group down
    finally:
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
