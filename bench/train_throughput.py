"""Training throughput of the trainer's own step against plain Hugging Face training of the
same model on the same sequences, in the same run.

    python bench/train_throughput.py            # CUDA: Qwen2.5-1.5B shape; CPU: a small Qwen2
    python bench/train_throughput.py --steps 5 --shape small
    python bench/train_throughput.py --shape tiny --steps 1   # seconds on CPU (the CI check)

Like for like: both sides compute the same documents, unpadded, in micro-batches of at most
the same token budget, with activation checkpointing off or on for both (`--checkpointing`;
`pairings`), and tokens/s counts those real tokens on both sides.

Ours: `TrainStep` (packed, balanced micro-batches, per-document attention, chunked
log-prob head, PPO token loss, clipping, the trainer's AdamW: fused on CUDA; on CUDA FSDP2
bf16 mixed precision over a mesh of one). Peer: plain Hugging Face training, padding-free
as Hugging Face does it (`DataCollatorWithFlattening`'s layout): the documents of a
micro-batch concatenated into one `[1, T]` row with `position_ids` restarting at each
document and no attention mask, from which transformers builds the per-document causal mask
(`masking_utils.find_packed_sequence_indices`; a transformers without it gets the padded
`[b, T]` batch, and the report says `padded`); `model(...).logits`, log_softmax of the full
logits, the same PPO-style token loss (no loss across a document boundary), AdamW (fused on
CUDA, as the Hugging Face Trainer's default `adamw_torch_fused`; bf16 autocast on CUDA),
`gradient_checkpointing_enable` when checkpointing. Random weights, random tokens, response
lengths spread like RL rollouts.

Each side runs on a freshly built model, memory freed in between; a side that runs out of
CUDA memory is reported as `OOM` (a ratio is printed only when both of a pair ran). Prints
tokens/s, MFU, peak memory, and the ratio ours / peer per checkpointing setting.

MFU (CUDA; "n/a on CPU") counts model FLOPs, the PaLM appendix B / Chinchilla way, over
the tokens of each document (padding and recomputation are not useful work):

    FLOPs per step = 6 * N * tokens + 12 * layers * hidden * sum over documents of len^2

N: the parameters without the input embedding (a lookup, no FLOPs), the output head
counted (its matmul is real; once when tied); 12 * layers * hidden * len per token is
QK^T and AV forward and backward for a document of `len` tokens (no causal halving,
as in PaLM). Peak: 989 TFLOP/s (H100 SXM bf16 dense).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

SHAPES = {
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),
    "small": dict(vocab_size=32768, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
PEAK_FLOPS = 989e12


def build(shape: str, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=shape != "1.5b")
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains (1.5B initialised on the host: seconds a side)
        return Qwen2ForCausalLM(config)


def flops_per_step(model, lengths: list[int]) -> tuple[float, int]:
    """Model FLOPs of one training step over documents of `lengths` tokens (see the module
    docstring), and N (parameters without the input embedding, output head counted)."""
    config = model.config
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    n = sum(p.numel() for p in model.parameters()) - emb.numel() + (head.numel() if head is emb else 0)
    attn_width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    attention = 12 * config.num_hidden_layers * attn_width * sum(n_tok * n_tok for n_tok in lengths)
    return 6 * n * sum(lengths) + attention, n


def make_rows(num: int, vocab: int, prompt: int, max_response: int, seed: int = 1):
    from rlhf_trainer.data.sequences import Row

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num):
        r = int(torch.randint(max(max_response // 8, 1), max_response + 1, (1,), generator=gen))
        rows.append(Row(torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
                        torch.randint(0, vocab, (r,), generator=gen).tolist(), [0.0] * r,
                        float(torch.rand(1, generator=gen) > 0.5),
                        0.0, False))
    return rows


def pairings(modes: list[bool]) -> list[tuple[str, str, bool]]:
    """(label, side, checkpointing) in run order: ours then the peer, for each checkpointing
    setting; the two of a pair differ in nothing else."""
    return [(f"{name} ({'checkpointing' if ckpt else 'no checkpointing'})", side, ckpt)
            for ckpt in modes for name, side in (("rlhf_trainer", "ours"), ("plain HF", "peer"))]


def pack(seqs: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Consecutive documents in micro-batches of at most `budget` tokens (a longer document
    alone): the peer's micro-batches."""
    out: list[list[list[int]]] = []
    for s in seqs:
        if out and sum(map(len, out[-1])) + len(s) <= budget:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def can_pack() -> bool:
    """transformers builds a per-document mask from position_ids (no attention mask)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def packed_inputs(chunk: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [1, T], position_ids [1, T], loss mask [1, T-1]: 1 where the next token is
    of the same document)."""
    ids = torch.tensor([t for s in chunk for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in chunk])[None]
    same = torch.cat([torch.tensor([1.0] * (len(s) - 1) + [0.0]) for s in chunk])[None, :-1]
    return ids, pos, same


def hf_inputs(chunk: list[list[int]], packed: bool, device: torch.device) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """A micro-batch as plain Hugging Face training feeds it: (input_ids, the model's other
    keyword arguments, the loss mask of the next-token targets). Packed: one row, position_ids
    per document, no attention mask and no KV cache (transformers looks for packed documents
    only then). Padded: a `[b, T]` batch with its attention mask."""
    if packed:
        ids, pos, mask = (t.to(device) for t in packed_inputs(chunk))
        return ids, {"position_ids": pos, "use_cache": False}, mask
    width = max(len(x) for x in chunk)
    ids = torch.zeros(len(chunk), width, dtype=torch.long)
    att = torch.zeros(len(chunk), width, dtype=torch.long)
    for i, x in enumerate(chunk):
        ids[i, :len(x)] = torch.tensor(x)
        att[i, :len(x)] = 1
    ids, att = ids.to(device), att.to(device)
    return ids, {"attention_mask": att, "use_cache": False}, att[:, 1:].float()


def ours(shape: str, rows, budget: int, device: torch.device, steps: int, checkpointing: bool | None = None) -> float:
    """Seconds per step of the trainer's `TrainStep` (one warm-up step first)."""
    from rlhf_contract.api.models import AlgorithmSpec
    from rlhf_contract.api.presets import PRESETS
    from rlhf_contract.trainer_config import OptimConfig
    from rlhf_trainer.models.logprob_head import attach_logprob_head
    from rlhf_trainer.optim import adamw
    from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats
    from rlhf_trainer.parallel.parallelize import parallelize_models
    from rlhf_trainer.engine import Fsdp2Engine
    from rlhf_trainer.rl.models import Models
    from rlhf_trainer.rl.step import TrainStep

    model = build(shape, device)
    a = AlgorithmSpec(**{**PRESETS["grpo"], "kl_coef": 0.0})
    layout = parallelize_models(model, ref=None, critic=None, world_size=1, tp=1, cp=1,
                                activation_checkpointing=(device.type == "cuda" if checkpointing is None
                                                          else checkpointing),
                                device_type=device.type)
    attach_logprob_head(model)
    step = TrainStep(a, Models(Fsdp2Engine(model, adamw(model, OptimConfig(learning_rate=1e-6)))), layout,
                     max_tokens_per_micro_batch=budget, max_grad_norm=1.0, temperature=1.0, device=device)
    stats = RolloutStats(reward_mean=0.0, reward_std=0.0, reward_min=0.0, reward_max=0.0, score_mean=0.0,
                         response_length_mean=0.0, response_length_min=0, response_length_max=0,
                         truncated_fraction=0.0, zero_std_group_fraction=0.0, dropped_group_fraction=0.0,
                         num_tokens=sum(len(r.prompt_ids) + len(r.response_ids) for r in rows))
    batch = RolloutBatch(rows, 8, stats)
    tensors = step.prepare(batch)
    step(batch, tensors)  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(batch, tensors)
    _sync(device)
    return (time.perf_counter() - start) / steps


def peer(shape: str, rows, budget: int, device: torch.device, steps: int, checkpointing: bool = False,
         packed: bool | None = None) -> float:
    """Seconds per step of plain Hugging Face training (one warm-up step first): padding-free
    micro-batches of at most `budget` tokens (`packed`, the default where transformers can),
    else padded `[b, T]` ones of as many documents."""
    model = build(shape, device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    chunks = pack([r.prompt_ids + r.response_ids for r in rows], budget)
    packed = can_pack() if packed is None else packed
    adv = torch.randn(len(rows), generator=torch.Generator().manual_seed(2))

    def loss_of(chunk, first: int) -> torch.Tensor:
        ids, kwargs, mask = hf_inputs(chunk, packed, device)
        if packed:
            doc = torch.repeat_interleave(adv[first:first + len(chunk)], torch.tensor([len(s) for s in chunk]))
            weight = doc[None, :-1].to(device)
        else:
            weight = adv[first:first + len(chunk), None].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids, **kwargs).logits
        logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        ratio = (logp - logp.detach()).exp()
        return -(ratio * weight * mask).sum() / mask.sum()

    def one_step():
        opt.zero_grad(set_to_none=True)
        first = 0
        for chunk in chunks:
            loss_of(chunk, first).backward()
            first += len(chunk)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    one_step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error))


def measure(side: Callable[[], float], device: torch.device) -> tuple[float | None, float]:
    """(seconds per step, or None if it ran out of memory; peak memory in GiB). The side
    builds its own model; everything it held is freed before returning."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = None
    try:
        seconds = side()
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
    gc.collect()  # the side's frames (model, optimizer, activations) are gone once the except block ends
    peak = _peak(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds, peak


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_pairs(shape: str, rows, budget: int, device: torch.device, steps: int, modes: list[bool]) -> list[dict]:
    """Each side of `pairings(modes)` measured: one row each (label, side, checkpointing,
    seconds per step or None for OOM, peak GiB, real tokens, tokens the side computed)."""
    tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    packed = can_pack()
    out = []
    for label, side, ckpt in pairings(modes):
        if side == "ours":
            seconds, memory = measure(lambda: ours(shape, rows, budget, device, steps, ckpt), device)
            computed = tokens
        else:
            seconds, memory = measure(lambda: peer(shape, rows, budget, device, steps, ckpt, packed), device)
            chunks = pack([r.prompt_ids + r.response_ids for r in rows], budget)
            computed = tokens if packed else sum(len(c) * max(map(len, c)) for c in chunks)
        out.append({"label": label, "side": side, "checkpointing": ckpt, "seconds": seconds, "peak_gib": memory,
                    "tokens": tokens, "computed_tokens": computed, "layout": "packed" if side == "ours" or packed
                    else "padded"})
    return out


def ratios(results: list[dict]) -> dict[bool, float | None]:
    """Ours / peer in tokens/s for each checkpointing setting (None where a side ran out of memory)."""
    by = {(r["side"], r["checkpointing"]): r["seconds"] for r in results}
    return {ckpt: (by[("peer", ckpt)] / by[("ours", ckpt)] if by[("peer", ckpt)] and by[("ours", ckpt)] else None)
            for ckpt in dict.fromkeys(r["checkpointing"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--shape", choices=SHAPES, default="1.5b" if cuda else "small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64 if cuda else 32)
    parser.add_argument("--prompt", type=int, default=256 if cuda else 64)
    parser.add_argument("--max-response", type=int, default=1024 if cuda else 192)
    parser.add_argument("--budget", type=int, default=16384 if cuda else 2048)
    parser.add_argument("--checkpointing", choices=("off", "on", "both"), default="both" if cuda else "off",
                        help="activation checkpointing on both sides (on CPU ours never checkpoints one process)")
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        rows = make_rows(args.rows, SHAPES[args.shape]["vocab_size"], args.prompt, args.max_response)
        lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
        tokens = sum(lengths)
        with torch.device("meta"):  # shapes only, no memory
            flops, n = flops_per_step(build(args.shape, torch.device("meta")), lengths)
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
        results = run_pairs(args.shape, rows, args.budget, device, args.steps, modes)
        unit = "GiB (CUDA peak)" if cuda else "GiB (process max RSS)"
        for r in results:
            t, m = r["seconds"], r["peak_gib"]
            if t is None:
                print(f"{r['label']}: OOM (out of CUDA memory; peak {m:.2f} {unit})")
                continue
            mfu = f"MFU {flops / t / PEAK_FLOPS:.1%}" if cuda else "MFU n/a on CPU"
            print(f"{r['label']}: {tokens / t:,.0f} tokens/s, {t:.3f} s/step, {mfu}, memory {m:.2f} {unit}, "
                  f"{r['layout']} ({r['computed_tokens']} tokens computed)")
        print(f"shape {args.shape} ({n:,} parameters without the input embedding), {len(rows)} sequences, "
              f"{tokens} tokens per step (real, counted on both sides), {flops:.3g} model FLOPs per step")
        for ckpt, ratio in ratios(results).items():
            setting = "checkpointing" if ckpt else "no checkpointing"
            print(f"ratio rlhf_trainer / plain HF tokens/s ({setting}): "
                  + (f"{ratio:.2f}" if ratio else "n/a (a side ran out of memory)"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
