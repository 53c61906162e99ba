"""Balanced sequence packing: assignment properties, the packed row, padding fractions,
and packed forward == unpacked forward on the tiny model."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_trainer.data.balanced_packing import Packed, balanced_micro_batches, pack, padding_fraction


@pytest.mark.parametrize("seed", range(40))
def test_balance_properties(seed):
    rng = random.Random(seed)
    budget = rng.choice([16, 64, 300])
    num_ranks = rng.choice([1, 2, 3, 4, 8])
    lengths = [rng.randint(1, budget) for _ in range(rng.randint(0, 60))]
    out = balanced_micro_batches(lengths, budget, num_ranks)

    assert len(out) == num_ranks
    assert len({len(mbs) for mbs in out}) == 1  # lockstep: same number of micro-batches
    flat = [i for mbs in out for mb in mbs for i in mb]
    assert sorted(flat) == list(range(len(lengths)))  # every sequence exactly once
    for mbs in out:
        assert all(sum(lengths[i] for i in mb) <= budget for mb in mbs)
        # empty micro-batches only pad the end
        sizes = [len(mb) for mb in mbs]
        assert sizes == sorted(sizes, key=lambda s: s == 0)
    totals = [sum(lengths[i] for mb in mbs for i in mb) for mbs in out]
    if lengths:
        assert max(totals) - min(totals) <= max(lengths)


def test_known_assignment():
    # longest first to the least-loaded rank: 9 -> r0, 8 -> r1, 5 -> r1 (8 < 9), 4 -> r0,
    # 3 -> r0 (13 = 13, lower rank wins); then first-fit-decreasing into bins of 10
    lengths = [3, 9, 5, 8, 4]
    out = balanced_micro_batches(lengths, 10, 2)
    assert out == [[[1], [4, 0]], [[3], [2]]]
    # one rank: 9 | 8 | 5+4 | 3 (3 fits in no earlier bin: rooms 1, 2, 1)
    assert balanced_micro_batches(lengths, 10, 1) == [[[1], [3], [2, 4], [0]]]


def test_fewer_sequences_than_ranks_pads_with_empty_micro_batches():
    assert balanced_micro_batches([4], 8, 3) == [[[0]], [[]], [[]]]
    assert balanced_micro_batches([], 8, 2) == [[], []]


def test_too_long_sequence_names_the_budget():
    with pytest.raises(ValueError, match=r"sequence 1 has 9 tokens, more than max_tokens_per_micro_batch \(8\)"):
        balanced_micro_batches([3, 9], 8, 2)


def test_pack_layout():
    p = pack([[5, 6, 7], [8], [9, 10]], pad_to_multiple_of=4, pad_id=0)
    assert isinstance(p, Packed)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    assert p.document_ids.tolist() == [[0, 0, 0, 1, 2, 2, 3, 3]]
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6] and p.cu_seqlens.dtype == torch.int32
    assert p.num_padding == 2
    assert pack([[1, 2]]).num_padding == 0
    empty = pack([], pad_to_multiple_of=2)  # the dummy row of an empty micro-batch
    assert empty.input_ids.shape == (1, 2) and empty.cu_seqlens.tolist() == [0]


def test_padding_fraction():
    mbs = [[4, 1], [2], []]
    # padded: 2 x 4 + 1 x 2 = 10 slots for 7 tokens
    assert padding_fraction(mbs, packed=False) == pytest.approx(3 / 10)
    assert padding_fraction(mbs, packed=True) == 0.0
    # packed, rounded to 4: 5 -> 8, 2 -> 4: 12 slots for 7 tokens
    assert padding_fraction(mbs, packed=True, pad_to_multiple_of=4) == pytest.approx(5 / 12)
    assert padding_fraction([], packed=True) == 0.0


def _per_document_logprobs(logits: torch.Tensor, ids: torch.Tensor, cu: list[int]) -> list[torch.Tensor]:
    logp = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return [logp[a:b - 1] for a, b in zip(cu[:-1], cu[1:])]  # next token within the document


@pytest.mark.parametrize("attention", ["sdpa", "eager", "explicit-mask"])
def test_packed_forward_equals_unpacked(attention):
    from rlhf_trainer.models.builtin import build_tiny_qwen2
    from rlhf_trainer.parallel.context_parallel import apply_cp

    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 16, (n,), generator=gen).tolist() for n in (7, 1, 12, 4, 9)]
    model = build_tiny_qwen2(0).eval()
    with torch.no_grad():
        alone = [torch.log_softmax(model(input_ids=torch.tensor([d])).logits[0, :-1], -1)
                 .gather(-1, torch.tensor(d[1:])[:, None])[:, 0] for d in docs]
        if attention == "explicit-mask":
            apply_cp(model, None)  # CP attention without a mesh: explicit document mask
        else:
            model.set_attn_implementation(attention)
        p = pack(docs, pad_to_multiple_of=8)
        kwargs = {"document_ids": p.document_ids} if attention == "explicit-mask" else {}
        # use_cache=False matters: with a cache HF skips the packed-sequence detection
        logits = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, **kwargs).logits
    packed = _per_document_logprobs(logits, p.input_ids, p.cu_seqlens.tolist())
    assert [len(x) for x in packed] == [len(d) - 1 for d in docs]
    for a, b in zip(packed, alone):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and the mask matters: without position ids the documents see each other
    with torch.no_grad():
        leak = {"document_ids": torch.zeros_like(p.document_ids)} if attention == "explicit-mask" else {}
        leaky = model(input_ids=p.input_ids, use_cache=False, **leak).logits
    assert not torch.allclose(_per_document_logprobs(leaky, p.input_ids, p.cu_seqlens.tolist())[2], alone[2],
                              atol=1e-3)
