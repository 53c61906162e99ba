"""The log-prob head's forward + backward per micro-batch: every position with the entropy
differentiated (what the head did before) against response positions only with the
entropy as a metric (what it does at `algorithm.entropyCoef` 0), in the same run.

    python bench/logprob_head.py                       # CPU: hidden 896, vocab 32768, 4096 tokens
    python bench/logprob_head.py --vocab 151936 --tokens 8192 --prompt-fraction 0.25

Random hidden states and head weight; `--prompt-fraction` of the tokens are prompt
positions (RL rows: a prompt, then a response). Prints milliseconds per pass for each
mode and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from rlhf_trainer.models.logprob_head import _at_positions, _linear_chunk_stats, chunked_token_stats


def run(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
        entropy: str) -> None:
    stats = _at_positions(hidden, positions, targets if positions is None else targets[0, positions],
                          lambda h, t: chunked_token_stats(_linear_chunk_stats, h, (weight, None), t, 1.0,
                                                           entropy=entropy))
    loss = stats[..., 0].sum() + (stats[..., 1].sum() if entropy == "grad" else 0.0)
    loss.backward()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--prompt-fraction", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.hidden, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * args.hidden ** -0.5).to(device).requires_grad_()
    targets = torch.randint(0, args.vocab, (1, args.tokens), generator=gen).to(device)
    prompt = int(args.tokens * args.prompt_fraction)
    positions = torch.arange(prompt, args.tokens, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    before = timed(lambda: (run(hidden, weight, targets, None, "grad"), sync()), args.repeats)
    after = timed(lambda: (run(hidden, weight, targets, positions, "value"), sync()), args.repeats)
    print(f"device {device.type}, hidden {args.hidden}, vocab {args.vocab}, {args.tokens} tokens "
          f"({prompt} prompt positions)")
    print(f"every position, entropy differentiated:   {before:9.1f} ms per forward+backward")
    print(f"response positions, entropy as a metric: {after:9.1f} ms per forward+backward")
    print(f"ratio (before / after): {before / after:.2f}x")


if __name__ == "__main__":
    main()
