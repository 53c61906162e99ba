"""Rollout throughput of the CPU engine against Hugging Face `generate`, same run.

64 prompts x 32 new tokens on a small Qwen2 (random weights, made in code), sampled with
EOS ignored so both sides generate the same number of tokens. The engine is a separate
process reached over HTTP with one request per prompt (as the trainer's client sends
them, so the engine must batch concurrent requests); the peer is `model.generate` on the
whole batch in this process. Prints tokens/s of each and the ratio.

    .venv/bin/python bench/rollout.py [--prompts 64] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from rlhf_launcher.local import free_port
from rlhf_trainer.rollout import RolloutClient


def make_model(path: Path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlhf_trainer.models.builtin import build_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=16, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return model, AutoTokenizer.from_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 13, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    total = args.prompts * args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = make_model(Path(tmp))
        port = free_port()
        engine = subprocess.Popen([sys.executable, "-m", "rlhf_inference.cpu_engine", "--model", tmp, "--host", "127.0.0.1",
                                   "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = RolloutClient([f"http://127.0.0.1:{port}"])
            client.wait_ready(120)
            engine_s = []
            for i in range(3):
                start = time.perf_counter()
                out = client.generate_sync(prompts, n=1, max_tokens=args.tokens, temperature=1.0, seed=i)
                engine_s.append(time.perf_counter() - start)
            assert sum(len(s[0].token_ids) for s in out) > 0
            stats = httpx.get(f"http://127.0.0.1:{port}/stats").json()
        finally:
            engine.terminate()
            engine.wait(30)
        # the peer: transformers' batched generate, in process, no HTTP
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        hf_s = []
        for i in range(3):
            torch.manual_seed(i)
            start = time.perf_counter()
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, max_new_tokens=args.tokens,
                                     min_new_tokens=args.tokens, pad_token_id=0)
            hf_s.append(time.perf_counter() - start)
        assert gen.shape[1] - width == args.tokens
    print(f"{args.prompts} prompts x {args.tokens} tokens, best of 3")
    print(f"CPU engine over HTTP (one request per prompt): {total / min(engine_s):.0f} tokens/s "
          f"(largest batch {stats.get('max_batch_size')})")
    print(f"transformers generate, one batch in process:  {total / min(hf_s):.0f} tokens/s")
    print(f"ratio engine / transformers: {min(hf_s) / min(engine_s):.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
