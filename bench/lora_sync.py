"""LoRA weight sync: merged weights (what we send) against adapter files (vLLM's
`/v1/load_lora_adapter` route), measured in the same run.

1. Bytes per sync at real shapes (Qwen2 0.5B, 1.5B, 7B configs, built on the meta device
   with our own `add_adapters`, rank 16, all-linear): the merged model in bf16 vs the
   adapters in bf16. Their ratio is what the adapter route would save on the wire.
2. On this CPU, a Qwen2 of ~60M parameters with rank-16 adapters: the time to produce the
   merged tensors (`merged_tensors`, W + scaling x B A per wrapped weight) against reading
   the same tensors unmerged (the cost merging adds to a sync), and the time to write the
   adapter file (`save_adapter`) against writing the merged weights as safetensors.

    .venv/bin/python bench/lora_sync.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from rlhf_contract.api.models import LoraSpec
from rlhf_trainer.models.lora import add_adapters, merged_tensors, save_adapter

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab (the published Qwen2 configs)
    "Qwen2-0.5B": (896, 4864, 24, 14, 2, 151936),
    "Qwen2-1.5B": (1536, 8960, 28, 12, 2, 151936),
    "Qwen2-7B": (3584, 18944, 28, 28, 4, 152064),
}


def qwen2(hidden, inter, layers, heads, kv, vocab, device="meta"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=hidden < 1024)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = LoraSpec(rank=16, alpha=32)
    print("bytes per sync, bf16 (merged model vs adapters):")
    for name, shape in SHAPES.items():
        model = add_adapters(qwen2(*shape), spec)
        base = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
        adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
        print(f"  {name:11s} merged {2 * base / 1e9:6.2f} GB  adapters {2 * adapters / 1e6:7.1f} MB  "
              f"ratio {base / adapters:6.1f}x")

    torch.manual_seed(0)
    model = add_adapters(qwen2(1024, 2816, 6, 16, 4, 8192, device="cpu"), spec)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.01)
    items = list(model.named_parameters())
    total = sum(p.numel() for n, p in items if ".lora_" not in n)

    def merged():
        for _ in merged_tensors(model, items)[1]:
            pass

    def unmerged():
        for n, p in items:
            if ".lora_" not in n:
                p.detach().clone()

    t_merged, t_plain = best(merged, args.rounds), best(unmerged, args.rounds)
    print(f"CPU, {total / 1e6:.0f}M-parameter Qwen2, rank 16: merged tensors {t_merged * 1e3:.0f} ms, "
          f"unmerged copies {t_plain * 1e3:.0f} ms: merge overhead ratio {t_merged / t_plain:.2f}")
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        def write_adapter():
            save_adapter(Path(tmp) / "adapter", model, spec, "base")

        def write_merged():
            specs, tensors = merged_tensors(model, items)
            save_file({s[0]: t.to(torch.bfloat16) for s, t in zip(specs, tensors)}, str(Path(tmp) / "m.safetensors"))

        t_adapter, t_full = best(write_adapter, args.rounds), best(write_merged, args.rounds)
    print(f"write: adapter file {t_adapter * 1e3:.0f} ms, merged bf16 safetensors {t_full * 1e3:.0f} ms: "
          f"ratio {t_full / t_adapter:.1f}x")


if __name__ == "__main__":
    main()
