"""Padding of balanced packed micro-batches vs padded `[b, T]` micro-batches.

Lengths are long-tailed (lognormal, like RL rollouts: most answers short, a few hit the
cap). Both schemes get the same token budget per micro-batch and the same ranks:
- padded: a fixed micro-batch size b = budget // max_len (so the worst case fits), the
  sequences in arrival order, each micro-batch padded to its longest sequence;
- packed: `balanced_micro_batches` + `pack` (rounded up to `--pad-to-multiple-of`).

Prints padding fractions, compute slots and forward passes (the slowest rank's count,
since ranks run in lockstep) and the ratios padded / packed. Takes about a second.

    python bench/packing.py [--num-seqs 4096 --max-len 8192 --budget 16384 --ranks 8]
"""

from __future__ import annotations

import argparse
import math
import random

from rlhf_trainer.data.balanced_packing import balanced_micro_batches, padding_fraction


def lognormal_lengths(n: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    median = max_len / 16
    return [max(1, min(max_len, round(rng.lognormvariate(math.log(median), 1.0)))) for _ in range(n)]


def padded_scheme(lengths: list[int], budget: int, max_len: int, ranks: int) -> list[list[list[int]]]:
    b = max(1, budget // max_len)
    per_rank = [lengths[r::ranks] for r in range(ranks)]
    return [[seqs[i:i + b] for i in range(0, len(seqs), b)] for seqs in per_rank]


def slots(mbs: list[list[int]], packed: bool, multiple: int) -> int:
    if packed:
        return sum(-(-sum(mb) // multiple) * multiple for mb in mbs if mb)
    return sum(len(mb) * max(mb) for mb in mbs if mb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=4096)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=16384, help="max tokens per micro-batch")
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks")
    parser.add_argument("--pad-to-multiple-of", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    lengths = lognormal_lengths(args.num_seqs, args.max_len, args.seed)
    m = args.pad_to_multiple_of
    packed_idx = balanced_micro_batches(lengths, args.budget, args.ranks)
    packed = [[[lengths[i] for i in mb] for mb in mbs] for mbs in packed_idx]
    padded = padded_scheme(lengths, args.budget, args.max_len, args.ranks)

    rows = []
    for name, per_rank, is_packed in (("padded", padded, False), ("packed", packed, True)):
        flat = [mb for mbs in per_rank for mb in mbs]
        rank_tokens = [sum(map(sum, mbs)) for mbs in per_rank]
        rows.append({
            "name": name,
            "padding": padding_fraction(flat, packed=is_packed, pad_to_multiple_of=m),
            "slots": slots(flat, is_packed, m),
            "passes": max(len(mbs) for mbs in per_rank),
            "imbalance": max(rank_tokens) / (sum(rank_tokens) / len(rank_tokens)),
        })
    total = sum(lengths)
    print(f"{args.num_seqs} sequences, lognormal lengths (median {args.max_len // 16}, cap {args.max_len}), "
          f"mean {total / len(lengths):.0f}, {total} tokens; budget {args.budget} tokens per "
          f"micro-batch; {args.ranks} ranks")
    print(f"{'scheme':8} {'padding':>8} {'token slots':>12} {'passes/rank':>12} {'max/mean rank tokens':>21}")
    for r in rows:
        print(f"{r['name']:8} {r['padding']:8.2%} {r['slots']:12d} {r['passes']:12d} {r['imbalance']:21.3f}")
    pad, pk = rows
    print(f"padded / packed: token slots x{pad['slots'] / pk['slots']:.2f} (padding {pad['padding']:.2%} "
          f"vs {pk['padding']:.2%}), forward passes x{pad['passes'] / pk['passes']:.2f}")


if __name__ == "__main__":
    main()
