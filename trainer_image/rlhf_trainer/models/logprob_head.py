"""The chunked log-prob head: `attach_logprob_head(model)` gives `model.lm_head` a
forward that computes, chunk by chunk of tokens, the log-probability of the target token
and the entropy at the sampling temperature, with the chunk's logits recomputed in the
backward pass (activation checkpointing per chunk). It runs only when `models.forward`
asks it to (the plain head otherwise), and only at the positions asked for (the
predicting positions of response tokens: prompt positions never reach the head).

Entropy has three modes: "grad" (a loss term: `algorithm.entropyCoef` > 0), "value"
(the metric only: computed once under no_grad in the forward, neither recomputed nor
differentiated) and "none" (no-grad passes and offline methods, which read log-probs
only). At entropyCoef 0 the backward of a chunk is the log-softmax's alone.

Log-probs never hold fp32 logits for a whole micro-batch: peak memory of the head is one
chunk's [chunk, vocab] in fp32, whatever the micro-batch budget. With tensor parallelism
the head is vocabulary-parallel: each rank multiplies by its own rows of the
(column-parallel) head weight and only three numbers per token cross the tensor-parallel
group (the softmax normaliser, the expected logit for the entropy and the target's
logit), so no rank ever holds [tokens, vocab] logits (Megatron's parallel cross-entropy,
extended with the entropy).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils.checkpoint import checkpoint

HEAD_CHUNK_TOKENS = 1024
"""Tokens per chunk of the log-prob head: [1024, 151936] fp32 is 0.6 GB."""


ENTROPY_MODES = ("grad", "value", "none")


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: str = "grad") -> torch.Tensor:
    """[n, V] logits, [n] targets -> [n, 2]: (log p(target), entropy) at `temperature`;
    `entropy` as in the module docstring ("none": zeros)."""
    scaled = logits.float() / temperature
    logz = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if entropy == "grad":
        ent = logz - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    elif entropy == "value":
        with torch.no_grad():
            ent = logz - (torch.exp(scaled - logz.unsqueeze(-1)) * scaled).sum(-1)
    else:
        ent = torch.zeros_like(logp, requires_grad=False)
    return torch.stack([logp, ent], dim=-1)


def _linear_chunk_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        targets: torch.Tensor, temperature: float, entropy: str = "grad") -> torch.Tensor:
    return token_stats(F.linear(hidden, weight, bias), targets, temperature, entropy)


def chunked_token_stats(fn, inputs: torch.Tensor, extra: tuple, targets: torch.Tensor, temperature: float,
                        chunk: int = HEAD_CHUNK_TOKENS, extra_after: tuple = (), entropy: str = "grad") -> torch.Tensor:
    """Apply `fn(inputs_chunk, *extra, targets_chunk, temperature, *extra_after,
    entropy=...)` over chunks of tokens ([1, l, ...] -> [1, l, 2]); with gradients, each
    chunk is recomputed in backward (collectives in `fn` rerun in the same order on every
    rank). An entropy of mode "value" is computed in the forward only: the recomputation
    asks `fn` for "none" (no-grad work saves no tensors, so the recomputed graph matches)."""
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy mode {entropy!r}: use one of {ENTROPY_MODES}")
    flat_in, flat_t = inputs.reshape(-1, inputs.shape[-1]), targets.reshape(-1)
    outs = []
    grad = torch.is_grad_enabled() and (inputs.requires_grad or any(
        isinstance(e, torch.Tensor) and e.requires_grad for e in extra))
    for start in range(0, flat_in.shape[0], chunk):
        args = (flat_in[start:start + chunk], *extra, flat_t[start:start + chunk], temperature, *extra_after)
        if not grad:
            outs.append(fn(*args, entropy=entropy))
            continue
        calls = iter(range(2))  # the first call is the forward, the second the recomputation
        mode = (lambda e=entropy, c=calls: e if next(c, 1) == 0 or e == "grad" else "none")
        outs.append(checkpoint(lambda *a, m=mode: fn(*a, entropy=m()), *args, use_reentrant=False))
    out = torch.cat(outs) if outs else flat_in.new_zeros(0, 2, dtype=torch.float32)
    return out.reshape(*targets.shape, 2)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce SUM forward, identity backward: the partial sums of each rank feed a
    result that every rank of the group then uses identically (Megatron's
    reduce-from-tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _vocab_parallel_chunk_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                targets: torch.Tensor, temperature: float, group: dist.ProcessGroup,
                                vocab_start: int, entropy: str = "grad") -> torch.Tensor:
    """[n, H] hidden, this rank's [V_r, H] rows of the head (vocabulary ids
    `vocab_start` ... `vocab_start + V_r - 1`), [n] targets -> [n, 2] (log p(target),
    entropy) over the whole vocabulary, with z = logits / temperature:

        m = max_v z_v (all-reduce MAX, no gradient),  e_v = exp(z_v - m)
        S = sum_v e_v,  E = sum_v e_v z_v,  Z_t = z_target     (each an all-reduce SUM of
                                                                the ranks' partial sums)
        log p(target) = Z_t - (m + log S),   entropy = (m + log S) - E / S
    """
    z = F.linear(hidden, weight, bias).float() / temperature
    m = z.detach().amax(dim=-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m.unsqueeze(-1))
    local_t = targets - vocab_start
    owned = (local_t >= 0) & (local_t < z.shape[-1])
    z_t = z.gather(-1, local_t.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * owned
    if entropy == "grad":
        ez = (e * z).sum(-1)
    else:  # the same collective either way (recomputation reruns it in the same order)
        with torch.no_grad():
            ez = (e * z).sum(-1) if entropy == "value" else torch.zeros_like(z_t)
    s, expected, z_t = _SumOverGroup.apply(torch.stack([e.sum(-1), ez, z_t]), group)
    log_z = m + s.log()
    ent = log_z - expected / s
    if entropy != "grad":
        ent = ent.detach() if entropy == "value" else torch.zeros_like(ent)
    return torch.stack([z_t - log_z, ent], dim=-1)


def _vocab_parallel_head(self, hidden: DTensor, targets: torch.Tensor, temperature: float,
                         positions: torch.Tensor | None, entropy: str) -> DTensor:
    """Column-parallel head (weight `Shard(0)` over the vocabulary on the TP mesh; the
    input arrives replicated): token stats without gathering logits."""
    weight = self.weight
    mesh = weight.device_mesh
    group = mesh.get_group()
    rows = -(-weight.shape[0] // mesh.size())  # DTensor shards like torch.chunk
    # each rank's input gradient is a partial sum over its vocabulary rows
    local_hidden = hidden.to_local(grad_placements=[Partial()]) if isinstance(hidden, DTensor) else hidden
    bias = getattr(self, "bias", None)
    bias = bias.to_local() if isinstance(bias, DTensor) else bias
    self._rlhf_vocab_parallel_calls = getattr(self, "_rlhf_vocab_parallel_calls", 0) + 1
    stats = _at_positions(local_hidden, positions, targets, lambda h, t: chunked_token_stats(
        _vocab_parallel_chunk_stats, h, (weight.to_local(), bias), t, temperature,
        extra_after=(group, mesh.get_local_rank() * rows), entropy=entropy))
    # replicated on the TP ranks; the head's output hook expects a DTensor
    return DTensor.from_local(stats, mesh, [Replicate()], run_check=False)


def _at_positions(hidden: torch.Tensor, positions: torch.Tensor | None, targets: torch.Tensor,
                  stats_of) -> torch.Tensor:
    """`stats_of(h, t)` ([1, n, H], [n] -> [1, n, 2]) run on the rows `positions` of
    `hidden` [1, l, H] only (`targets` theirs), scattered back into zeros [1, l, 2] (None:
    every position, `targets` [1, l]). No position at all (an empty micro-batch, a context
    parallel slice of prompt tokens) still runs the head on one row at weight 0: its
    weight then has a gradient on every rank, as FSDP's reduce-scatter needs."""
    if positions is None:
        return stats_of(hidden, targets)
    if positions.numel() == 0:
        anchor = stats_of(hidden[:, :1], torch.zeros(1, dtype=torch.long, device=hidden.device)).sum() * 0.0
        return hidden.new_zeros(hidden.shape[0], hidden.shape[1], 2, dtype=torch.float32) + anchor
    stats = stats_of(hidden[:, positions], targets).reshape(hidden.shape[0], -1, 2)
    return stats.new_zeros(hidden.shape[0], hidden.shape[1], 2).index_copy(1, positions, stats)


def _head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    request = getattr(self, "_rlhf_request", None)
    if request is None:  # not called by policy_forward: behave as the plain head
        return self._rlhf_plain_forward(hidden)
    targets, temperature, positions, entropy = request
    weight, bias = self.weight, getattr(self, "bias", None)
    if isinstance(weight, DTensor):  # tensor parallel (FSDP alone gives plain unsharded weights here)
        return _vocab_parallel_head(self, hidden, targets, temperature, positions, entropy)
    return _at_positions(hidden, positions, targets, lambda h, t: chunked_token_stats(
        _linear_chunk_stats, h, (weight, bias), t, temperature, entropy=entropy))


def attach_logprob_head(model: torch.nn.Module) -> torch.nn.Module:
    """Give `model.lm_head` the chunked log-prob forward (parameter names unchanged);
    under tensor parallelism it is vocabulary-parallel (the head's weight placement, a
    DTensor, decides)."""
    head = model.get_output_embeddings()
    if getattr(head, "_rlhf_plain_forward", None) is not None:
        return model
    head._rlhf_plain_forward = head.forward
    head.forward = types.MethodType(_head_forward, head)
    return model


def has_logprob_head(model: torch.nn.Module) -> bool:
    return getattr(model.get_output_embeddings(), "_rlhf_plain_forward", None) is not None


def request_stats(model: torch.nn.Module, targets: torch.Tensor | None, temperature: float = 1.0,
                  positions: torch.Tensor | None = None, entropy: str = "grad") -> None:
    """Make the next forward of `model`'s head return token stats [1, l, 2] for `targets`
    ([n] at `positions`, the local rows that need them; None: [1, l] at every position),
    zeros elsewhere; `targets=None`: back to the plain head."""
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy mode {entropy!r}: use one of {ENTROPY_MODES}")
    model.get_output_embeddings()._rlhf_request = (
        None if targets is None else (targets, temperature, positions, entropy))
