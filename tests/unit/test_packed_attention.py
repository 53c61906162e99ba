"""Packed attention without a dense mask (plain and each context-parallel rank's slice),
and the log-prob head's work: response positions only, no entropy graph at entropyCoef 0.

The multi-process context-parallel runs (values and gradients of whole models against
one process forwarding each document alone) are tests/distributed/test_parallel.py;
here the kernel itself is checked for every rank's slice in one process, against the
dense-mask reference, with the tensors it creates recorded."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf_trainer.data.micro_batches import plan
from rlhf_trainer.data.sequences import Row
from rlhf_trainer.models.builtin import build_tiny_qwen2
from rlhf_trainer.models.forward import policy_forward
from rlhf_trainer.models.logprob_head import HEAD_CHUNK_TOKENS, attach_logprob_head, chunked_token_stats, token_stats
from rlhf_trainer.parallel.context_parallel import AttentionSegments, segment_attention


class Recorder(TorchDispatchMode):
    """Every aten op run, and the shapes of the tensors it returned."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func.overloadpacket.__name__),
                         [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]))
        return out

    def largest(self) -> int:
        return max((int(torch.tensor(s).prod()) for _, shapes in self.ops for s in shapes if s), default=0)


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The dense reference the segments encode: a boolean mask [b, L, L] (True = attend) where
    key j is visible to query i iff j <= i and both are in the same document."""
    pos = torch.arange(document_ids.shape[-1])
    return (document_ids[:, :, None] == document_ids[:, None, :]) & (pos[None, None, :] <= pos[None, :, None])


def bounds_of(lengths: list[int]) -> tuple[int, ...]:
    return (0, *itertools.accumulate(lengths))


@pytest.mark.parametrize("lengths,cp", [([30, 40, 26], 1), ([30, 40, 26], 2), ([7, 50, 3, 20, 16], 3),
                                        ([96], 4), ([1, 1, 94], 2)])
def test_every_ranks_slice_matches_the_dense_mask_reference_without_building_it(lengths, cp):
    torch.manual_seed(0)
    total, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q = torch.randn(1, heads, total, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, dtype=torch.float64, requires_grad=True)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    weights = torch.randn(1, total, heads, dim, dtype=torch.float64)

    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc)[:, None],
                                           enable_gqa=True).transpose(1, 2)
    ref_grads = torch.autograd.grad((dense * weights).sum(), (q, k, v))

    seq = total // cp
    outs, largest, block = [], 0, 0
    for rank in range(cp):  # each rank: its query slice against the whole row's keys
        seg = AttentionSegments.build(bounds_of(lengths), rank * seq, seq)
        with Recorder() as rec:
            out = segment_attention(q[:, :, rank * seq:(rank + 1) * seq], k, v, seg, None, True)
        largest = max(largest, rec.largest())
        block = max(block, *((q_hi - q_lo) * (k_hi - k_lo) for q_lo, q_hi, k_lo, k_hi in seg.segments))
        outs.append(out)
    out = torch.cat(outs, dim=1)
    assert torch.allclose(out, dense, atol=1e-12)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    for got, ref in zip(grads, ref_grads):
        assert torch.allclose(got, ref, atol=1e-10)
    # nothing larger than one document's own [queries, keys] block or the q / k / v tensors
    assert largest <= max(block, heads * total * dim), largest
    if block < seq * total:  # several documents: less than the dense path's mask alone
        assert largest < max(seq * total, heads * total * dim + 1)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_segments_are_what_flash_varlen_takes(cp):
    """The CUDA path hands the segments to `varlen_attn` as cumulative offsets over ONE
    contiguous key range: check that range is contiguous and covers the offsets, for
    random packings, and run torch's own varlen op on the meta device with them."""
    from torch.nn.attention.varlen import varlen_attn

    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        lengths = torch.randint(1, 40, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
        pad = (-sum(lengths)) % cp
        if pad:
            lengths.append(pad)
        total, seq = sum(lengths), sum(lengths) // cp
        for rank in range(cp):
            seg = AttentionSegments.build(bounds_of(lengths), rank * seq, seq)
            keys = [(k_lo, k_hi) for _, _, k_lo, k_hi in seg.segments]
            assert all(a[1] == b[0] for a, b in zip(keys, keys[1:]))  # one contiguous key range
            assert seg.cu_q.tolist()[-1] == seq and seg.cu_k.tolist()[-1] == keys[-1][1] - keys[0][0]
            assert keys[-1][1] == (rank + 1) * seq  # no key after the rank's last query
            out = varlen_attn(torch.empty(seq, 4, 64, device="meta", dtype=torch.bfloat16),
                              torch.empty(keys[-1][1] - keys[0][0], 2, 64, device="meta", dtype=torch.bfloat16),
                              torch.empty(keys[-1][1] - keys[0][0], 2, 64, device="meta", dtype=torch.bfloat16),
                              seg.cu_q.to("meta"), seg.cu_k.to("meta"), seg.max_q, seg.max_k,
                              window_size=(-1, 0), enable_gqa=True)
            assert out.shape == (seq, 4, 64)


@pytest.mark.parametrize("features", [{"is_causal"}, {"window_size", "scale"}, {"window_size", "scale", "enable_gqa"}])
def test_varlen_arguments_for_an_older_torch_keep_the_attention(features):
    """What `varlen_arguments` hands a `varlen_attn` lacking `enable_gqa` or `scale` (torch
    2.10 / 2.11 on the GPU machine) attends as GQA with the model's scale does: run
    through SDPA as the kernel would take them (its default scale, no GQA where it has
    none), against SDPA with `enable_gqa` and the scale."""
    from rlhf_trainer.parallel.context_parallel import varlen_arguments

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, h, 16, generator=gen) for h in (6, 2, 2))
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, scale=0.3, enable_gqa=True)
    q2, k2, v2, kwargs = varlen_arguments(frozenset(features), q, k, v, 0.3, gqa=True)
    assert kwargs.get("window_size", (-1, 0)) == (-1, 0) and kwargs.get("is_causal", True)
    got = F.scaled_dot_product_attention(q2.transpose(0, 1), k2.transpose(0, 1), v2.transpose(0, 1), is_causal=True,
                                         scale=kwargs.get("scale"), enable_gqa=kwargs.get("enable_gqa", False))
    torch.testing.assert_close(got, expected)
    assert (k2.shape[1] == 2) == ("enable_gqa" in features)  # K and V repeated only where the kernel cannot group


def _rows(n: int, seed: int = 0) -> list[Row]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, 16, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        response = torch.randint(3, 16, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        out.append(Row(prompt, response, [0.0] * len(response), 1.0, 0.0, False))
    return out


def _head_ops(entropy: str) -> tuple[Recorder, Recorder, torch.Tensor, dict]:
    policy = build_tiny_qwen2(0)
    attach_logprob_head(policy)
    data = _rows(6)
    [mb] = plan(data, list(range(6)), budget=128, dp_size=1, cp_size=1)[0]
    vocab = policy.config.vocab_size
    with Recorder() as forward:
        logp, ent = policy_forward(policy, mb, None, torch.device("cpu"), 1.0, entropy)
    loss = logp.sum() + (ent.sum() if entropy == "grad" else 0.0)
    with Recorder() as backward:
        loss.backward()
    responses = sum(len(r.response_ids) for r in data)
    head = [s for name, shapes in forward.ops if name in ("mm", "addmm", "linear") for s in shapes if s[-1] == vocab]
    assert head and all(s[0] == responses for s in head), (head, responses)  # the head ran on response positions only
    return forward, backward, ent, {n: p.grad.clone() for n, p in policy.named_parameters()}


def test_the_head_has_no_entropy_graph_at_entropy_coef_zero():
    _, grad_bwd, ent_grad, _ = _head_ops("grad")
    value_fwd, value_bwd, ent_value, value_grads = _head_ops("value")
    vocab, responses = build_tiny_qwen2(0).config.vocab_size, sum(len(r.response_ids) for r in _rows(6))

    def vocab_ops(rec: Recorder) -> list[str]:
        """The ops over the head's [tokens, vocab] tensors."""
        return [name for name, shapes in rec.ops if (responses, vocab) in shapes]

    assert torch.allclose(ent_grad, ent_value)  # the metric is unchanged
    assert "_softmax_backward_data" in vocab_ops(grad_bwd) and "_softmax_backward_data" not in vocab_ops(value_bwd)
    assert len(vocab_ops(value_bwd)) < len(vocab_ops(grad_bwd))
    # the entropy is computed once, in the forward: the recomputation in backward skips it
    assert vocab_ops(value_fwd).count("exp") == 1  # one chunk
    assert "_softmax" in vocab_ops(grad_bwd) and "_softmax" not in vocab_ops(value_bwd)
    # and the log-prob gradients are those of the plain computation
    _, _, _, none_grads = _head_ops("none")
    for name, g in value_grads.items():
        assert torch.allclose(g, none_grads[name]), name


def test_entropy_modes_agree_with_the_plain_formula():
    logits = torch.randn(1, 2 * HEAD_CHUNK_TOKENS + 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (1, 2 * HEAD_CHUNK_TOKENS + 5))
    full = token_stats(logits[0], targets[0], 0.7)
    value = chunked_token_stats(token_stats, logits, (), targets, 0.7, entropy="value")
    none = chunked_token_stats(token_stats, logits, (), targets, 0.7, entropy="none")
    assert torch.allclose(value[0], full, atol=1e-6)
    assert torch.equal(value[..., 0], none[..., 0]) and not none[..., 1].any()
    # "value": no gradient flows through the entropy; "grad": it does
    assert not torch.autograd.grad(value[..., 1].sum(), logits, retain_graph=True)[0].any()
    grad = chunked_token_stats(token_stats, logits, (), targets, 0.7, entropy="grad")
    assert torch.autograd.grad(grad[..., 1].sum(), logits)[0].abs().sum() > 0
    with pytest.raises(ValueError, match="entropy mode"):
        chunked_token_stats(token_stats, logits, (), targets, 0.7, entropy="sometimes")


def test_a_micro_batch_without_response_positions_still_gives_the_head_a_gradient():
    """An empty micro-batch (FSDP lockstep) or a context-parallel slice of prompt tokens:
    the head is still in the graph at weight 0, so every rank reduce-scatters the same
    gradients (an untied head with no gradient on one rank would desynchronise FSDP)."""
    policy = build_tiny_qwen2(0)
    attach_logprob_head(policy)
    head = policy.get_output_embeddings()
    assert head.weight is not policy.get_input_embeddings().weight  # untied
    data = [Row([3, 4, 5, 6], [7], [0.0], 1.0, 0.0, False)]
    [mb] = plan(data, [0], budget=16, dp_size=1, cp_size=1)[0]
    mb.response_lengths[0] = 0  # no predicting position at all
    logp, ent = policy_forward(policy, mb, None, torch.device("cpu"), 1.0, "value")
    assert not logp.any() and not ent.any()
    logp.sum().backward()
    assert head.weight.grad is not None and not head.weight.grad.any()
